//! Sum all-reduce over NCCL between the CUDA devices of one process, through CubeCL's compute
//! client (cubecl-cuda always links NCCL through cudarc).
//!
//! burn 0.21's own route, its `distributed` feature, makes `Autodiff<B>` require a distributed
//! backend, which the CPU backends are not: a `--features cuda` build (CPU backends included)
//! could not have it. This module calls the same client operation burn's CubeCL backend does
//! (`ComputeClient::all_reduce`, then `sync_collective`), without that feature.

use std::marker::PhantomData;

use burn::tensor::backend::DeviceId;
use burn::tensor::ops::FloatTensor;
use burn::tensor::TensorMetadata;
use burn_cubecl::ops::numeric;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
use burn_fusion::stream::{Operation, OperationStreams};
use burn_fusion::{Fusion, FusionBackend, FusionRuntime};
use burn_ir::{CustomOpIr, HandleContainer, OperationIr, TensorIr};
use cubecl::cuda::CudaRuntime;
use cubecl::server::ReduceOperation;

/// Backends whose float tensors can be summed across CUDA devices over NCCL.
pub trait NcclOps: burn::tensor::backend::Backend {
    /// `tensor` summed element-wise over the ranks on `devices` (rank `r` on `devices[r]`).
    ///
    /// Every rank calls it, concurrently, from its own thread, with a tensor of the same shape
    /// and dtype; all get the sum. The first call on a set of devices creates their NCCL
    /// communicator, which waits until every rank has joined.
    fn nccl_all_reduce_sum(tensor: FloatTensor<Self>, devices: &[DeviceId]) -> FloatTensor<Self>;
}

impl<F, I, BT> NcclOps for CubeBackend<CudaRuntime, F, I, BT>
where
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn nccl_all_reduce_sum(tensor: FloatTensor<Self>, devices: &[DeviceId]) -> FloatTensor<Self> {
        let out = owned_contiguous(tensor);
        let mut client = out.client.clone();
        client.all_reduce(
            out.handle.clone(),
            out.handle.clone(),
            out.dtype.into(),
            devices.to_vec(),
            ReduceOperation::Sum,
        );
        // Later kernels on the compute stream wait for the communication stream.
        client.sync_collective();
        out
    }
}

/// A buffer NCCL may overwrite: `tensor` itself when it is contiguous and not shared, else a
/// contiguous copy.
fn owned_contiguous(tensor: CubeTensor<CudaRuntime>) -> CubeTensor<CudaRuntime> {
    if tensor.handle.can_mut() && tensor.is_contiguous() {
        return tensor;
    }
    let zeros = numeric::zeros_client::<CudaRuntime>(
        tensor.client.clone(),
        tensor.device.clone(),
        tensor.shape(),
        tensor.dtype,
    );
    numeric::add(zeros, tensor)
}

/// The all-reduce as an operation of the fusion stream: it runs when the stream reaches it, on
/// the inner backend's tensor.
#[derive(Clone, Debug)]
struct AllReduceOp<B> {
    desc: CustomOpIr,
    devices: Vec<DeviceId>,
    _b: PhantomData<B>,
}

impl<B: FusionBackend + NcclOps> Operation<B::FusionRuntime> for AllReduceOp<B> {
    fn execute(&self, h: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>) {
        let t = h.get_float_tensor::<B>(&self.desc.inputs[0]);
        let sum = B::nccl_all_reduce_sum(t, &self.devices);
        h.register_float_tensor::<B>(&self.desc.outputs[0].id, sum);
    }
}

impl<B: FusionBackend + NcclOps> NcclOps for Fusion<B> {
    fn nccl_all_reduce_sum(tensor: FloatTensor<Self>, devices: &[DeviceId]) -> FloatTensor<Self> {
        let client = tensor.client.clone();
        let streams = OperationStreams::with_inputs([&tensor]);
        let out = TensorIr::uninit(client.create_empty_handle(), tensor.shape(), tensor.dtype);
        let desc = CustomOpIr::new("conrub_nccl_all_reduce", &[tensor.into_ir()], &[out]);
        let op = AllReduceOp::<B> {
            desc: desc.clone(),
            devices: devices.to_vec(),
            _b: PhantomData,
        };
        let mut outs = client.register(streams, OperationIr::Custom(desc), op);
        // Every rank must reach NCCL: run the stream now rather than leave the op queued.
        let sum = outs.remove(0);
        client.sync(|| ());
        sum
    }
}
