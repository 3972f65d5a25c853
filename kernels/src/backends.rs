//! The CPU backends and libtorch run the portable fallback.

#[cfg(feature = "flex")]
impl crate::GrpoOps for burn::backend::Flex {
    fn kv_write(pool: burn::tensor::ops::FloatTensor<Self>, slots: &[u32], values: burn::tensor::ops::FloatTensor<Self>) -> burn::tensor::ops::FloatTensor<Self> {
        crate::kv::write_flex(pool, slots, values)
    }

    fn sample_rows(
        logits: burn::tensor::ops::FloatTensor<Self>,
        params: &crate::sampling::SampleParams,
        uniforms: &[f64],
    ) -> (burn::tensor::ops::IntTensor<Self>, burn::tensor::ops::FloatTensor<Self>) {
        let (t, l) = crate::sampling::sample_rows_flex(burn::tensor::Tensor::from_primitive(burn::tensor::TensorPrimitive::Float(logits)), params, uniforms);
        (t.into_primitive(), l.into_primitive().tensor())
    }
}

#[cfg(feature = "ndarray")]
mod ndarray {
    use burn::backend::ndarray::{FloatNdArrayElement, IntNdArrayElement, NdArray, NdArrayTensor, QuantElement, SharedArray};

    impl<E: FloatNdArrayElement, I: IntNdArrayElement, Q: QuantElement> crate::GrpoOps for NdArray<E, I, Q>
    where
        NdArrayTensor: From<SharedArray<E>>,
        NdArrayTensor: From<SharedArray<I>>,
    {
        fn kv_write(pool: burn::tensor::ops::FloatTensor<Self>, slots: &[u32], values: burn::tensor::ops::FloatTensor<Self>) -> burn::tensor::ops::FloatTensor<Self> {
            crate::kv::write_by_runs::<Self>(pool, slots, values)
        }
    }
}

#[cfg(feature = "tch")]
impl<E: burn::backend::libtorch::TchElement> crate::GrpoOps for burn::backend::LibTorch<E> {}
