//! How one row's hidden states over its criterion's span become one vector: a setting
//! (`pooling` of a probe judge, `--pooling` of `conrub judge distill`).

pub use conrub_settings::Pooling;
