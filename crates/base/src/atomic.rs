//! Atomic whole-file writes.

use std::io::Write;
use std::path::{Path, PathBuf};

/// An I/O error on a file, naming it.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {source}")]
pub struct FileError {
    /// The file (or, for the final directory sync, its directory).
    pub path: PathBuf,
    /// What the operating system said.
    #[source]
    pub source: std::io::Error,
}

/// `Result` with a [`FileError`].
pub type Result<T> = std::result::Result<T, FileError>;

/// Atomic whole-file write (temporary file, fsync, rename, directory fsync).
pub fn write_bytes_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = AtomicFile::create(path)?;
    f.write_all(bytes).map_err(|source| FileError {
        path: path.to_path_buf(),
        source,
    })?;
    f.commit()
}

/// A file written through a temporary file next to its path and renamed over it by
/// [`AtomicFile::commit`]: the data is flushed and fsynced, the file renamed into place, and then the
/// parent directory is fsynced so the rename itself survives a crash. Dropped without a commit, or
/// when the commit fails, it removes the temporary file and leaves the old one in place.
///
/// This is the workspace's one "write to a temporary file, then rename" helper: every crate that
/// replaces a file whole goes through it (or [`write_bytes_atomic`]).
pub struct AtomicFile {
    path: PathBuf,
    tmp: PathBuf,
    dir: PathBuf,
    out: Option<std::io::BufWriter<std::fs::File>>,
    /// True once the temporary file has been renamed into place (nothing left to clean up).
    renamed: bool,
}

impl AtomicFile {
    /// Starts writing `path` (its parent directory is created when missing).
    pub fn create(path: &Path) -> Result<Self> {
        let io = |source| FileError {
            path: path.to_path_buf(),
            source,
        };
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        std::fs::create_dir_all(&dir).map_err(io)?;
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let tmp = dir.join(format!(".{name}.tmp.{}", std::process::id()));
        let f = std::fs::File::create(&tmp).map_err(io)?;
        Ok(Self {
            path: path.to_path_buf(),
            tmp,
            dir,
            out: Some(std::io::BufWriter::new(f)),
            renamed: false,
        })
    }

    /// The final path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Flushes and fsyncs the data, renames it into place and fsyncs the directory. On an error
    /// the temporary file is removed (the old file, if any, is untouched unless the rename
    /// already happened, in which case only the directory sync failed).
    pub fn commit(mut self) -> Result<()> {
        let io = |source| FileError {
            path: self.path.clone(),
            source,
        };
        let out = self.out.take().expect("not committed yet");
        let f = out.into_inner().map_err(|e| io(e.into_error()))?;
        f.sync_all().map_err(io)?;
        drop(f);
        std::fs::rename(&self.tmp, &self.path).map_err(io)?;
        self.renamed = true;
        sync_dir(&self.dir).map_err(|source| FileError {
            path: self.dir.clone(),
            source,
        })
    }
}

/// Fsyncs a directory, so that a rename inside it is durable. On platforms where a directory
/// cannot be opened as a file (Windows) there is nothing to do.
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        std::fs::File::open(dir)?.sync_all()
    }
    #[cfg(not(unix))]
    {
        let _ = dir;
        Ok(())
    }
}

impl Write for AtomicFile {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.out.as_mut().expect("not committed").write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.out.as_mut().expect("not committed").flush()
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        // Not committed, or the commit failed before the rename: the temporary file goes.
        drop(self.out.take());
        if !self.renamed {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_write_replaces_the_file_whole_and_leaves_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("sub").join("a.json");
        write_bytes_atomic(&p, b"old").unwrap();
        write_bytes_atomic(&p, b"new").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"new");
        assert_eq!(std::fs::read_dir(p.parent().unwrap()).unwrap().count(), 1);
    }

    #[test]
    fn an_uncommitted_file_leaves_the_old_one_in_place() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.txt");
        std::fs::write(&p, "old").unwrap();
        let mut f = AtomicFile::create(&p).unwrap();
        f.write_all(b"half").unwrap();
        drop(f);
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "old");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn a_failed_rename_names_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let taken = dir.path().join("taken");
        std::fs::create_dir(&taken).unwrap();
        std::fs::write(taken.join("x"), "x").unwrap();
        let e = write_bytes_atomic(&taken, b"new").unwrap_err();
        assert_eq!(e.path, taken);
        assert!(std::error::Error::source(&e).is_some());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1, "{e}");
    }

    #[test]
    fn directory_sync_errors_are_reported() {
        let dir = tempfile::tempdir().unwrap();
        sync_dir(dir.path()).unwrap();
        #[cfg(unix)]
        assert!(
            sync_dir(&dir.path().join("missing")).is_err(),
            "a directory that cannot be synced is an error, not ignored"
        );
    }
}
