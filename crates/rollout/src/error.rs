//! The crate's errors are the contracts' ([`ContractError`]): a rollout call fails on an
//! argument out of range or a device readback, both of which `conrub_contracts` names (so a
//! model's own sampler and the engine report the same kinds).

pub use conrub_contracts::{ContractError, Result};
