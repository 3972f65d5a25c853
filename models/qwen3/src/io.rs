//! Small file helpers.

use std::io::Write;
use std::path::Path;

use crate::error::{Qwen3Error, Result};

/// Writes `bytes` to `path` atomically: a temporary file in the same directory, fsync, rename.
/// A crash leaves either the old file or the new one, never a torn file.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "out".into());
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    result.map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        Qwen3Error::io(path, e)
    })
}
