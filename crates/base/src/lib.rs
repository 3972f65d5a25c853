//! The plain leaves every conrub crate shares and none owns, with no model, rubric or judge in
//! them, so that the model crate and the data crates need not depend on each other:
//!
//! - [`Message`]: one chat turn, of a rubric record's prompt and of a model's chat template
//!   (re-exported as `conrub_rubric::Message` and `conrub_models::Message`: one type).
//! - [`AtomicFile`] and [`write_bytes_atomic`]: the workspace's one "write a temporary file,
//!   fsync, rename, fsync the directory" helper; a crash leaves the old file or the new one.
//!   Errors are [`FileError`]s naming the path.
//! - [`retry`] with a [`Backoff`]: the one retry loop of every client of a server (the judge
//!   client, the SGLang rollout client, the HTTP reward function); the caller says which
//!   failures are worth another [`Attempt`].
//! - [`shown_url`] and [`endpoint`]: a server URL as every message shows it (no user, password
//!   or query) and with an API path appended before its query.

mod atomic;
mod message;
mod retry;
mod url;

pub use atomic::{sync_dir, write_bytes_atomic, AtomicFile, FileError};
pub use message::Message;
pub use retry::{retry, Attempt, Backoff, GaveUp};
pub use url::{endpoint, shown_url};
