//! A CubeCL runtime that compiles instead of running: its compiler is the CUDA one (CubeCL's
//! C++ generator with the CUDA dialect, as `cubecl-cuda` uses), its device properties are those
//! `cubecl-cuda` registers for an sm_90 device, and its server records the CUDA C++ of every
//! kernel launched on it. No driver, device or toolkit is touched.
//!
//! Launching our kernels through the same launch functions as the real backend (see
//! `super::launches`) is what makes the recorded sources the ones an H200 would compile: the
//! launcher's geometry (tile sizes, units per cube) reads these properties.

use std::future::ready;
use std::sync::{Arc, Mutex};

use cubecl::device::{Device, DeviceId, DeviceService, ServerUtilitiesHandle};
use cubecl::ir::features::{AtomicUsage, Plane, TypeUsage};
use cubecl::ir::{
    ContiguousElements, DeviceProperties, ElemType, FloatKind, HardwareProperties, MatrixLayout,
    MemoryDeviceProperties, MmaProperties, StorageType, TargetProperties, Type, VectorSize,
};
use cubecl::prelude::*;
use cubecl::profile::TimingMethod;
use cubecl::server::{
    Binding, ComputeServer, ExecutionMode, KernelArguments, ProfileError, ProfilingToken,
    ServerCommunication, ServerError, ServerUtilities,
};
use cubecl::stream_id::StreamId;
use cubecl::zspace::{Shape, Strides};
use cubecl::{CubeTask, MemoryUsage};
use cubecl_cpp::cuda::arch::CudaArchitecture;
use cubecl_cpp::cuda::mma::CudaWmmaCompiler;
use cubecl_cpp::cuda::CudaDialect;
use cubecl_cpp::shared::{
    register_mma_features, register_wmma_features, CompilationOptions, CppCompiler,
    CppSupportedFeatures,
};
use cubecl_cpp::DialectWmmaCompiler;
use cubecl_runtime::allocator::ContiguousMemoryLayoutPolicy;
use cubecl_runtime::logging::ServerLogger;
use cubecl_runtime::memory_management::{ManagedMemoryHandle, MemoryAllocationMode};
use cubecl_runtime::storage::{BytesStorage, ComputeStorage, ManagedResource};

use super::arch::{Arch, OfflineError};

/// CubeCL's CUDA compiler (what `cubecl-cuda` compiles with, without its `ptx-wmma` feature).
pub type CudaCompiler = CppCompiler<CudaDialect<CudaWmmaCompiler>>;

/// One kernel launch, compiled to CUDA C++.
#[derive(Debug, Clone)]
pub struct RecordedKernel {
    /// The entry point's name in the source.
    pub entry: String,
    /// The CUDA C++ source, as CubeCL hands it to NVRTC.
    pub source: String,
    /// Units per cube (threads per block).
    pub threads: u32,
    /// Dynamic shared memory the launch asks for, bytes (CubeCL puts every shared array there).
    pub dynamic_shared_bytes: usize,
}

/// What the server recorded since the last [`take_recorded`]: a kernel, or why it did not compile.
static RECORDED: Mutex<Vec<Result<RecordedKernel, OfflineError>>> = Mutex::new(Vec::new());

/// Takes the kernels recorded so far, in launch order.
pub(crate) fn take_recorded() -> Vec<Result<RecordedKernel, OfflineError>> {
    std::mem::take(&mut *RECORDED.lock().unwrap_or_else(|e| e.into_inner()))
}

/// The device of [`OfflineCuda`]: one per architecture (its index is the sm version).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct OfflineDevice {
    /// Compute capability times ten (90 for sm_90).
    pub sm: u16,
}

impl Default for OfflineDevice {
    fn default() -> Self {
        Self { sm: Arch::SM90.sm }
    }
}

/// Device type id of [`OfflineDevice`], apart from every real runtime's.
const DEVICE_TYPE: u16 = 0x0ff1;

impl Device for OfflineDevice {
    fn from_id(device_id: DeviceId) -> Self {
        Self {
            sm: device_id.index_id,
        }
    }

    fn to_id(&self) -> DeviceId {
        DeviceId {
            type_id: DEVICE_TYPE,
            index_id: self.sm,
        }
    }
}

/// A CubeCL runtime with CUDA's compiler and a recording server (see the module docs).
#[derive(Debug, Clone)]
pub struct OfflineCuda;

impl Runtime for OfflineCuda {
    type Compiler = CudaCompiler;
    type Server = RecordingServer;
    type Device = OfflineDevice;

    fn client(device: &Self::Device) -> ComputeClient<Self> {
        ComputeClient::load(device)
    }

    fn name(_client: &ComputeClient<Self>) -> &'static str {
        "cuda-offline"
    }

    fn require_array_lengths() -> bool {
        true // as cubecl-cuda
    }

    fn max_cube_count() -> (u32, u32, u32) {
        (i32::MAX as u32, u16::MAX as u32, u16::MAX as u32)
    }

    fn can_read_tensor(_shape: &Shape, _strides: &Strides) -> bool {
        true
    }

    fn target_properties() -> TargetProperties {
        // cubecl-cuda's values; only matrix-multiply-accumulate code reads them.
        TargetProperties {
            mma: MmaProperties {
                register_size_bits: 32,
                const_plane_size: 32,
                register_layout_a: MatrixLayout::RowMajor,
                register_layout_b: MatrixLayout::ColMajor,
                register_layout_acc: MatrixLayout::RowMajor,
                register_duplication_a: 1,
                register_duplication_b: 1,
                register_duplication_acc: 1,
                contiguous_elements: ContiguousElements::new(
                    cubecl_cpp::cuda::mma::contiguous_elements_cuda,
                ),
            },
        }
    }

    fn enumerate_devices(_: u16, _: &()) -> Vec<DeviceId> {
        Vec::new()
    }
}

/// The server of [`OfflineCuda`]: allocations are bookkeeping only, and a launch compiles the
/// kernel to CUDA C++ with the options `cubecl-cuda` uses on the architecture, and records it.
#[derive(Debug)]
pub struct RecordingServer {
    utilities: Arc<ServerUtilities<Self>>,
    logger: Arc<ServerLogger>,
    options: CompilationOptions,
}

impl DeviceService for RecordingServer {
    fn init(device_id: DeviceId) -> Self {
        let arch = Arch {
            sm: OfflineDevice::from_id(device_id).sm,
        };
        let logger = Arc::new(ServerLogger::default());
        let properties = device_properties(arch);
        let policy = ContiguousMemoryLayoutPolicy::new(properties.memory.alignment as usize);
        let utilities = Arc::new(ServerUtilities::new(properties, logger.clone(), (), policy));
        Self {
            utilities,
            logger,
            options: compilation_options(arch),
        }
    }

    fn utilities(&self) -> ServerUtilitiesHandle {
        self.utilities.clone() as ServerUtilitiesHandle
    }
}

impl ServerCommunication for RecordingServer {
    const SERVER_COMM_ENABLED: bool = false;
}

fn unsupported(what: &str) -> ServerError {
    ServerError::Generic {
        reason: format!("the offline CUDA runtime compiles kernels only; it cannot {what}"),
        backtrace: Default::default(),
    }
}

impl ComputeServer for RecordingServer {
    type Kernel = Box<dyn CubeTask<CudaCompiler>>;
    type Info = ();
    type MemoryLayoutPolicy = ContiguousMemoryLayoutPolicy;
    type Storage = BytesStorage;

    fn initialize_memory(&mut self, _: ManagedMemoryHandle, _: u64, _: StreamId) {}

    fn logger(&self) -> Arc<ServerLogger> {
        self.logger.clone()
    }

    fn utilities(&self) -> Arc<ServerUtilities<Self>> {
        self.utilities.clone()
    }

    fn read(
        &mut self,
        _: Vec<cubecl::server::CopyDescriptor>,
        _: StreamId,
    ) -> cubecl::future::DynFut<Result<Vec<cubecl::bytes::Bytes>, ServerError>> {
        Box::pin(ready(Err(unsupported("read memory"))))
    }

    fn write(
        &mut self,
        _: Vec<(cubecl::server::CopyDescriptor, cubecl::bytes::Bytes)>,
        _: StreamId,
    ) {
    }

    fn sync(&mut self, _: StreamId) -> cubecl::future::DynFut<Result<(), ServerError>> {
        Box::pin(ready(Ok(())))
    }

    fn get_resource(
        &mut self,
        _: Binding,
        _: StreamId,
    ) -> Result<ManagedResource<<BytesStorage as ComputeStorage>::Resource>, ServerError> {
        Err(unsupported("hand out memory"))
    }

    unsafe fn launch(
        &mut self,
        kernel: Self::Kernel,
        _count: CubeCount,
        _bindings: KernelArguments,
        mode: ExecutionMode,
        _stream_id: StreamId,
    ) {
        let compiled = kernel.compile(
            &mut Default::default(),
            &self.options,
            mode,
            kernel.address_type(),
        );
        let recorded = compiled
            .map(|k| RecordedKernel {
                entry: k.entrypoint_name,
                threads: k.cube_dim.num_elems(),
                dynamic_shared_bytes: k.repr.map_or(0, |r| r.shared_memory_size()),
                source: k.source,
            })
            .map_err(|e| OfflineError::Compile {
                kernel: kernel.name().to_string(),
                reason: e.to_string(),
            });
        RECORDED
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(recorded);
    }

    fn flush(&mut self, _: StreamId) -> Result<(), ServerError> {
        Ok(())
    }

    fn memory_usage(&mut self, _: StreamId) -> Result<MemoryUsage, ServerError> {
        Err(unsupported("report memory"))
    }

    fn memory_cleanup(&mut self, _: StreamId) {}

    fn start_profile(&mut self, _: StreamId) -> Result<ProfilingToken, ServerError> {
        Err(unsupported("profile"))
    }

    fn end_profile(
        &mut self,
        _: StreamId,
        _: ProfilingToken,
    ) -> Result<cubecl::profile::ProfileDuration, ProfileError> {
        Err(ProfileError::Unknown {
            reason: "the offline CUDA runtime does not profile".into(),
            backtrace: Default::default(),
        })
    }

    fn allocation_mode(&mut self, _: MemoryAllocationMode, _: StreamId) {}
}

/// The options `cubecl-cuda` compiles with on `arch` (CUDA 12.8 or newer).
fn compilation_options(arch: Arch) -> CompilationOptions {
    CompilationOptions {
        warp_size: 32,
        supports_features: CppSupportedFeatures {
            fast_math: true,
            grid_constants: arch.sm >= 70,
            fast_tanh: arch.sm >= 75,
            clusters: arch.sm >= 90,
            elect_sync: arch.sm >= 90,
        },
    }
}

/// The device properties `cubecl-cuda` registers for a device of `arch`, with the hardware
/// limits of the data-center part of that generation (H100/H200 for sm_90).
pub(crate) fn device_properties(arch: Arch) -> DeviceProperties {
    let limits = arch.limits();
    let hardware = HardwareProperties {
        load_width: 128,
        plane_size_min: 32,
        plane_size_max: 32,
        max_bindings: 1024,
        max_shared_memory_size: limits.max_shared_per_block,
        max_cube_count: OfflineCuda::max_cube_count(),
        max_units_per_cube: 1024,
        max_cube_dim: (1024, 1024, 64),
        num_streaming_multiprocessors: Some(limits.sms),
        num_tensor_cores: Some(4),
        min_tensor_cores_dim: Some(8),
        num_cpu_cores: None,
        max_vector_size: VectorSize::MAX,
    };
    let memory = MemoryDeviceProperties {
        max_page_size: limits.device_memory / 4,
        alignment: 512,
    };
    let mut props =
        DeviceProperties::new(Default::default(), memory, hardware, TimingMethod::System);
    cubecl_cpp::register_supported_types(&mut props);
    // The cooperative-matrix (WMMA) and manual MMA shapes `cubecl-cuda` registers for the
    // architecture, from the same compiler: the tensor-core kernels check for them.
    let cuda_arch = CudaArchitecture {
        version: u32::from(arch.sm),
    };
    register_wmma_features(
        <CudaWmmaCompiler as DialectWmmaCompiler<CudaDialect<CudaWmmaCompiler>>>::supported_wmma_combinations(&cuda_arch),
        &mut props,
    );
    register_mma_features(
        <CudaWmmaCompiler as DialectWmmaCompiler<CudaDialect<CudaWmmaCompiler>>>::supported_mma_combinations(&cuda_arch),
        &mut props,
    );
    props.register_type_usage(ElemType::Float(FloatKind::TF32), TypeUsage::Conversion);
    let atomic =
        |kind, size| Type::new(StorageType::Atomic(ElemType::Float(kind))).with_vector_size(size);
    props.register_atomic_type_usage(
        atomic(FloatKind::F64, 1),
        AtomicUsage::Add | AtomicUsage::LoadStore,
    );
    if arch.sm >= 70 {
        for size in [1, 2] {
            props.register_atomic_type_usage(
                atomic(FloatKind::F16, size),
                AtomicUsage::Add | AtomicUsage::LoadStore,
            );
        }
        props.features.plane.insert(Plane::Sync);
    }
    if arch.sm >= 90 {
        for size in [2, 4] {
            props.register_atomic_type_usage(
                atomic(FloatKind::F32, size),
                AtomicUsage::LoadStore | AtomicUsage::Add,
            );
        }
        props.features.cube_cluster = true;
    }
    if arch.sm >= 80 {
        props.features.copy_async = true;
    }
    props.features.memory_reinterpret = true;
    props.features.alignment = true;
    props.features.plane.insert(Plane::Ops);
    props.features.plane.insert(Plane::NonUniformControlFlow);
    props
}
