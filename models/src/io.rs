//! Small file helpers.

use std::path::Path;

use crate::error::{ModelError, Result};

/// Writes `bytes` to `path` atomically through the workspace's one helper,
/// [`conrub_base::write_bytes_atomic`]: a temporary file in the same directory, fsync, rename,
/// fsync of the directory. A crash leaves either the old file or the new one, never a torn file;
/// a failed write leaves no temporary file behind. The parent directory is created if needed.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    conrub_base::write_bytes_atomic(path, bytes).map_err(|e| ModelError::Io {
        path: e.path,
        source: e.source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_through_the_shared_helper() {
        let dir = tempfile::tempdir().unwrap();
        // The shared helper creates a missing parent folder (the old copy here did not).
        let p = dir.path().join("sub").join("config.json");
        write_atomic(&p, b"{}").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"{}");
        write_atomic(&p, b"{\"a\":1}").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"{\"a\":1}");
        assert_eq!(
            std::fs::read_dir(p.parent().unwrap()).unwrap().count(),
            1,
            "no temporary file left"
        );
        // A failed rename (a non-empty directory in the way) is an I/O error naming the path.
        let taken = dir.path().join("taken");
        std::fs::create_dir(&taken).unwrap();
        std::fs::write(taken.join("x"), "x").unwrap();
        let e = write_atomic(&taken, b"new").unwrap_err();
        assert!(
            matches!(&e, ModelError::Io { path, .. } if path == &taken),
            "{e}"
        );
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            2,
            "sub and taken only: {e}"
        );
    }
}
