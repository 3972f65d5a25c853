//! The CPU backends and libtorch run the portable fallback.

#[cfg(feature = "flex")]
impl crate::GrpoOps for burn::backend::Flex {}

#[cfg(feature = "ndarray")]
mod ndarray {
    use burn::backend::ndarray::{FloatNdArrayElement, IntNdArrayElement, NdArray, NdArrayTensor, QuantElement, SharedArray};

    impl<E: FloatNdArrayElement, I: IntNdArrayElement, Q: QuantElement> crate::GrpoOps for NdArray<E, I, Q>
    where
        NdArrayTensor: From<SharedArray<E>>,
        NdArrayTensor: From<SharedArray<I>>,
    {
    }
}

#[cfg(feature = "tch")]
impl<E: burn::backend::libtorch::TchElement> crate::GrpoOps for burn::backend::LibTorch<E> {}
