//! [`Collective`] over NCCL for ranks on CUDA devices (conrub-kernels' [`NcclOps`]; feature
//! `cuda` of this crate): the gradient buckets are summed device to device. Host numbers go
//! through a [`HostCollective`], which is also the barrier every rank passes before an NCCL call:
//! a rank enters NCCL only when all have arrived, so a rank that failed aborts the barrier
//! instead of leaving the others inside NCCL for ever.

use burn::tensor::backend::{Backend, DeviceId, DeviceOps};
use burn::tensor::{Tensor, TensorPrimitive};
use conrub_kernels::NcclOps;

use crate::collective::{Collective, HostCollective};
use crate::error::Result;

/// NCCL all-reduce between the devices of one process.
pub struct NcclCollective {
    devices: Vec<DeviceId>,
    host: HostCollective,
}

impl NcclCollective {
    /// The group of `devices`, rank `r` on `devices[r]`.
    pub fn new<B: Backend>(devices: &[B::Device]) -> Self {
        Self {
            devices: devices.iter().map(DeviceOps::id).collect(),
            host: HostCollective::new(devices.len()),
        }
    }
}

impl<B: NcclOps> Collective<B> for NcclCollective {
    fn world_size(&self) -> usize {
        self.devices.len()
    }

    fn all_reduce_sum(&self, rank: usize, bucket: Tensor<B, 1>) -> Result<Tensor<B, 1>> {
        Collective::<B>::all_gather(&self.host, rank, Vec::new())?;
        let sum = B::nccl_all_reduce_sum(bucket.into_primitive().tensor(), &self.devices);
        Ok(Tensor::from_primitive(TensorPrimitive::Float(sum)))
    }

    fn all_gather(&self, rank: usize, values: Vec<f64>) -> Result<Vec<Vec<f64>>> {
        Collective::<B>::all_gather(&self.host, rank, values)
    }

    fn abort(&self, rank: usize, error: &str) {
        Collective::<B>::abort(&self.host, rank, error);
    }
}
