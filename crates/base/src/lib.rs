//! The plain leaves every conrub crate shares and none owns, with no model, rubric or judge in
//! them, so that the model crate and the data crates need not depend on each other:
//!
//! - [`Message`]: one chat turn, of a rubric record's prompt and of a model's chat template
//!   (re-exported as `conrub_rubric::Message` and `conrub_models::Message`: one type).
//! - [`AtomicFile`] and [`write_bytes_atomic`]: the workspace's one "write a temporary file,
//!   fsync, rename, fsync the directory" helper; a crash leaves the old file or the new one.
//!   Errors are [`FileError`]s naming the path.

mod atomic;
mod message;

pub use atomic::{sync_dir, write_bytes_atomic, AtomicFile, FileError};
pub use message::Message;
