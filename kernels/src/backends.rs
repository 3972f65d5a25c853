//! The CPU backends run the fused host head ([`crate::cpu_head`]) for token log-probabilities and
//! the portable fallback for the rest; libtorch runs the fallback throughout.

#[cfg(feature = "flex")]
impl crate::host_head::HostF32 for burn::backend::Flex {
    /// Zero-copy where the tensor is a contiguous f32 buffer (the head and the gathered hidden
    /// states are); a cast or a contiguous copy otherwise.
    fn with_f32<R>(tensor: burn::tensor::ops::FloatTensor<Self>, f: impl FnOnce(&[f32]) -> R) -> R {
        use burn::tensor::ops::FloatTensorOps;
        let t = if tensor.dtype() == burn::tensor::DType::F32 {
            tensor
        } else {
            Self::float_cast(tensor, burn::tensor::FloatDType::F32)
        };
        let t = t.to_contiguous();
        let (off, n) = (t.layout().start_offset(), t.layout().num_elements());
        f(&t.storage::<f32>()[off..off + n])
    }
}

#[cfg(feature = "flex")]
impl crate::LossOps for burn::backend::Flex {
    /// `h · Wᵀ` with the head read through its strides (burn-flex's gemm takes any strides, so
    /// nothing is copied): the logits come out contiguous `[rows, vocab]`, which the sampler reads
    /// in place, where the default's `(W · hᵀ)ᵀ` view cost a strided copy per decode step.
    fn chunk_logits(
        hidden: burn::tensor::ops::FloatTensor<Self>,
        weight: burn::tensor::ops::FloatTensor<Self>,
    ) -> burn::tensor::ops::FloatTensor<Self> {
        let h = crate::prim::float::<Self, 2>(hidden);
        let w = crate::prim::float::<Self, 2>(weight);
        h.matmul(w.transpose()).into_primitive().tensor()
    }

    fn token_logprobs(
        hidden: burn::tensor::ops::FloatTensor<Self>,
        weight: burn::tensor::ops::FloatTensor<Self>,
        targets: burn::tensor::ops::IntTensor<Self>,
        chunk_tokens: usize,
    ) -> [burn::tensor::ops::FloatTensor<Self>; 3] {
        crate::host_head::token_logprobs::<Self>(hidden, weight, targets, chunk_tokens)
    }

    fn token_logprobs_backward(
        hidden: burn::tensor::ops::FloatTensor<Self>,
        weight: burn::tensor::ops::FloatTensor<Self>,
        targets: burn::tensor::ops::IntTensor<Self>,
        lse: burn::tensor::ops::FloatTensor<Self>,
        grad: burn::tensor::ops::FloatTensor<Self>,
        chunk_tokens: usize,
        want: (bool, bool),
    ) -> (
        Option<burn::tensor::ops::FloatTensor<Self>>,
        Option<burn::tensor::ops::FloatTensor<Self>>,
    ) {
        crate::host_head::token_logprobs_backward::<Self>(
            hidden,
            weight,
            targets,
            lse,
            grad,
            chunk_tokens,
            want,
        )
    }
}

#[cfg(feature = "flex")]
impl crate::AttentionOps for burn::backend::Flex {}

#[cfg(feature = "flex")]
impl crate::DecodeOps for burn::backend::Flex {
    fn kv_write(
        pool: burn::tensor::ops::FloatTensor<Self>,
        slots: &[u32],
        values: burn::tensor::ops::FloatTensor<Self>,
    ) -> burn::tensor::ops::FloatTensor<Self> {
        crate::kv::write_flex(pool, slots, values)
    }

    fn sample_rows(
        logits: burn::tensor::ops::FloatTensor<Self>,
        params: &crate::sampling::Decoding,
        uniforms: &[f64],
    ) -> (
        burn::tensor::ops::IntTensor<Self>,
        burn::tensor::ops::FloatTensor<Self>,
    ) {
        let (t, l) = crate::sampling::sample_rows_flex(
            burn::tensor::Tensor::from_primitive(burn::tensor::TensorPrimitive::Float(logits)),
            params,
            uniforms,
        );
        (t.into_primitive(), l.into_primitive().tensor())
    }
}

#[cfg(feature = "ndarray")]
mod ndarray {
    use burn::backend::ndarray::{
        FloatNdArrayElement, IntNdArrayElement, NdArray, NdArrayTensor, QuantElement, SharedArray,
    };
    use burn::tensor::ops::{FloatTensor, IntTensor};

    impl<E: FloatNdArrayElement, I: IntNdArrayElement, Q: QuantElement> crate::host_head::HostF32
        for NdArray<E, I, Q>
    where
        NdArrayTensor: From<SharedArray<E>>,
        NdArrayTensor: From<SharedArray<I>>,
    {
        /// A row-major f32 copy through `TensorData`.
        fn with_f32<R>(tensor: FloatTensor<Self>, f: impl FnOnce(&[f32]) -> R) -> R {
            f(&crate::host_head::to_host_f32::<Self>(tensor))
        }
    }

    impl<E: FloatNdArrayElement, I: IntNdArrayElement, Q: QuantElement> crate::LossOps
        for NdArray<E, I, Q>
    where
        NdArrayTensor: From<SharedArray<E>>,
        NdArrayTensor: From<SharedArray<I>>,
    {
        fn token_logprobs(
            hidden: FloatTensor<Self>,
            weight: FloatTensor<Self>,
            targets: IntTensor<Self>,
            chunk_tokens: usize,
        ) -> [FloatTensor<Self>; 3] {
            crate::host_head::token_logprobs::<Self>(hidden, weight, targets, chunk_tokens)
        }

        fn token_logprobs_backward(
            hidden: FloatTensor<Self>,
            weight: FloatTensor<Self>,
            targets: IntTensor<Self>,
            lse: FloatTensor<Self>,
            grad: FloatTensor<Self>,
            chunk_tokens: usize,
            want: (bool, bool),
        ) -> (Option<FloatTensor<Self>>, Option<FloatTensor<Self>>) {
            crate::host_head::token_logprobs_backward::<Self>(
                hidden,
                weight,
                targets,
                lse,
                grad,
                chunk_tokens,
                want,
            )
        }
    }

    impl<E: FloatNdArrayElement, I: IntNdArrayElement, Q: QuantElement> crate::AttentionOps
        for NdArray<E, I, Q>
    where
        NdArrayTensor: From<SharedArray<E>>,
        NdArrayTensor: From<SharedArray<I>>,
    {
    }

    impl<E: FloatNdArrayElement, I: IntNdArrayElement, Q: QuantElement> crate::DecodeOps
        for NdArray<E, I, Q>
    where
        NdArrayTensor: From<SharedArray<E>>,
        NdArrayTensor: From<SharedArray<I>>,
    {
        fn kv_write(
            pool: burn::tensor::ops::FloatTensor<Self>,
            slots: &[u32],
            values: burn::tensor::ops::FloatTensor<Self>,
        ) -> burn::tensor::ops::FloatTensor<Self> {
            crate::kv::write_by_runs::<Self>(pool, slots, values)
        }
    }
}

/// libtorch runs every family's fallback.
#[cfg(feature = "tch")]
mod tch {
    use burn::backend::libtorch::{LibTorch, TchElement};

    impl<E: TchElement> crate::LossOps for LibTorch<E> {}
    impl<E: TchElement> crate::AttentionOps for LibTorch<E> {}
    impl<E: TchElement> crate::DecodeOps for LibTorch<E> {}
}
