//! Parameters held in shards (`sharding = "full"`): each data-parallel rank keeps the parameters
//! it owns, and every other parameter is a placeholder. Before a segment of the model (a decoder
//! layer, the embedding and head) runs, its whole values are gathered from their owners through
//! a [`ParamGather`]; the gathered copy is dropped when the segment is done.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Tensor};

use crate::error::Result;

/// One gathered parameter: its whole value, flattened, and the shape it takes.
pub struct GatheredParam<B: AutodiffBackend> {
    /// Every element, in row-major order.
    pub values: Tensor<B::InnerBackend, 1>,
    /// The parameter's shape.
    pub shape: Vec<usize>,
}

/// Where the whole values of sharded parameters come from.
pub trait ParamGather<B: AutodiffBackend> {
    /// The whole values of the parameters `ids` (one segment of the model), in the order asked.
    ///
    /// A collective: every rank of a group asks for the same segments in the same order, so a
    /// policy that gathers must make the same calls whatever its batch holds.
    fn gather(&mut self, ids: &[ParamId]) -> Result<Vec<GatheredParam<B>>>;
}

/// `module` with every float parameter replaced by its whole value from `source`, cast to the
/// parameter's dtype, a tracked leaf where the parameter requires gradients (same ids, so a
/// backward through the copy yields gradients keyed as the original's).
pub fn gathered<B: AutodiffBackend, M: Module<B>>(
    module: &M,
    source: &mut dyn ParamGather<B>,
) -> Result<M> {
    gathered_as(module, source, None)
}

/// [`gathered`] with every parameter of two or more dimensions (the weight matrices) cast to
/// `matrices` when it is set: a copy for inference in the dtype the forward casts them to
/// anyway ([`crate::Policy::matrix_dtype`]), half the bytes of f32 under bf16-mixed. Vectors
/// (norm scales, biases) keep their dtype.
pub fn gathered_as<B: AutodiffBackend, M: Module<B>>(
    module: &M,
    source: &mut dyn ParamGather<B>,
    matrices: Option<DType>,
) -> Result<M> {
    struct Ids(Vec<ParamId>);
    impl<B: AutodiffBackend> ModuleVisitor<B> for Ids {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0.push(param.id);
        }
    }
    let mut ids = Ids(Vec::new());
    module.visit(&mut ids);
    let values = source.gather(&ids.0)?;
    if values.len() != ids.0.len() {
        return Err(crate::error::ContractError::Stage(format!(
            "a parameter gather returned {} values for {} parameters",
            values.len(),
            ids.0.len()
        )));
    }
    Ok(module.clone().map(&mut Swap {
        values: values.into_iter(),
        matrices,
    }))
}

/// Puts gathered values into a module's parameters, in visiting order.
struct Swap<B: AutodiffBackend> {
    values: std::vec::IntoIter<GatheredParam<B>>,
    matrices: Option<DType>,
}

impl<B: AutodiffBackend> ModuleMapper<B> for Swap<B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let g = self
            .values
            .next()
            .expect("one value per parameter (checked)");
        let require_grad = param.is_require_grad();
        let (id, placeholder, mapper) = param.consume();
        let dtype = match self.matrices {
            Some(m) if D >= 2 => m,
            _ => placeholder.dtype(),
        };
        drop(placeholder);
        let inner = g.values.reshape(burn::tensor::Shape::from(g.shape));
        let inner = if inner.dtype() == dtype {
            inner
        } else {
            inner.cast(dtype)
        };
        let value = Tensor::<B, D>::from_inner(inner);
        let value = if require_grad {
            value.require_grad()
        } else {
            value
        };
        Param::from_mapped_value(id, value, mapper)
    }
}
