//! Tensors from burn's backend primitives, for the ops' default implementations.

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Int, Tensor, TensorPrimitive};

/// A float primitive as a tensor of rank `D`.
pub(crate) fn float<B: Backend, const D: usize>(t: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// An int primitive as a tensor of rank `D`.
pub(crate) fn int<B: Backend, const D: usize>(t: IntTensor<B>) -> Tensor<B, D, Int> {
    Tensor::from_primitive(t)
}
