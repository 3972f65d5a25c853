//! A persistent judge cache in SQLite (WAL mode): safe with several writers, in one process or
//! many, and after a crash (a committed answer is either fully there or not at all).
//!
//! Keys are SHA-256 digests of length-prefixed parts: judge model, prompt version, call kind and
//! scoring mode, question, response(s) in the order shown, and criteria. Only valid answers are
//! stored; failures are retried on the next run.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use rusqlite::{params, Connection, OptionalExtension};
use sha2::{Digest, Sha256};

use crate::error::{JudgeError, Result};
use crate::judge::CriterionRequest;

/// A cache key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CacheKey(pub [u8; 32]);

impl CacheKey {
    /// Digest of the parts, each prefixed by its length so that no two part lists collide.
    pub fn of(parts: &[&str]) -> Self {
        let mut h = Sha256::new();
        for p in parts {
            h.update((p.len() as u64).to_le_bytes());
            h.update(p.as_bytes());
        }
        Self(h.finalize().into())
    }
}

impl CriterionRequest {
    /// The judge-cache key of this request under judge `judge` and prompt version `prompt_version`.
    pub fn cache_key(&self, judge: &str, prompt_version: &str) -> CacheKey {
        let n = self.criteria.len().to_string();
        let mut parts: Vec<&str> = vec![
            "criteria",
            judge,
            prompt_version,
            self.mode.as_str(),
            &self.question,
            &self.response,
            &n,
        ];
        parts.extend(self.criteria.iter().map(String::as_str));
        CacheKey::of(&parts)
    }
}

/// Lower-case hex of `bytes` (the digests in ids, prompt versions and file names).
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A stored answer: the raw text and the parsed value as JSON.
#[derive(Debug, Clone, PartialEq)]
pub struct CachedAnswer {
    /// Raw model output.
    pub raw: String,
    /// Parsed answer, serialised.
    pub parsed: String,
}

/// Hit and write counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Lookups answered from the cache.
    pub hits: u64,
    /// Lookups that found nothing.
    pub misses: u64,
    /// Answers stored.
    pub writes: u64,
    /// Database errors (treated as misses / skipped writes).
    pub errors: u64,
}

fn is_busy(e: &rusqlite::Error) -> bool {
    matches!(
        e.sqlite_error_code(),
        Some(rusqlite::ErrorCode::DatabaseBusy) | Some(rusqlite::ErrorCode::DatabaseLocked)
    )
}

/// The judge cache.
pub struct JudgeCache {
    path: PathBuf,
    conn: Mutex<Connection>,
    hits: AtomicU64,
    misses: AtomicU64,
    writes: AtomicU64,
    errors: AtomicU64,
}

impl std::fmt::Debug for JudgeCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JudgeCache")
            .field("path", &self.path)
            .finish()
    }
}

impl JudgeCache {
    /// Opens (or creates) the cache database at `path`.
    pub fn open(path: &Path) -> Result<Self> {
        let err = |e: rusqlite::Error| JudgeError::Cache {
            path: path.into(),
            source: e,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| JudgeError::CacheDir {
                path: path.into(),
                source: e,
            })?;
        }
        let conn = Connection::open(path).map_err(err)?;
        conn.busy_timeout(Duration::from_secs(60)).map_err(err)?;
        // Switching to WAL and creating the table take locks that SQLite does not always wait for
        // (several processes opening a fresh file at once get SQLITE_BUSY): retry for a while.
        let start = std::time::Instant::now();
        loop {
            match Self::init(&conn) {
                Ok(()) => break,
                Err(e) if is_busy(&e) && start.elapsed() < Duration::from_secs(60) => {
                    std::thread::sleep(Duration::from_millis(5 + rand::random::<u64>() % 20));
                }
                Err(e) => return Err(err(e)),
            }
        }
        Ok(Self {
            path: path.into(),
            conn: Mutex::new(conn),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            writes: AtomicU64::new(0),
            errors: AtomicU64::new(0),
        })
    }

    fn init(conn: &Connection) -> rusqlite::Result<()> {
        let mode: String = conn.query_row("PRAGMA journal_mode", [], |r| r.get(0))?;
        if !mode.eq_ignore_ascii_case("wal") {
            conn.pragma_update(None, "journal_mode", "WAL")?;
        }
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS judge_cache (
                key BLOB PRIMARY KEY,
                judge TEXT NOT NULL,
                kind TEXT NOT NULL,
                raw TEXT NOT NULL,
                parsed TEXT NOT NULL,
                created_unix INTEGER NOT NULL
            ) WITHOUT ROWID;
            CREATE TABLE IF NOT EXISTS criterion_requests (
                key BLOB PRIMARY KEY,
                request TEXT NOT NULL
            ) WITHOUT ROWID;",
        )
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Looks a key up; a database error counts as a miss.
    pub fn get(&self, key: &CacheKey) -> Option<CachedAnswer> {
        let conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        let row = conn
            .query_row(
                "SELECT raw, parsed FROM judge_cache WHERE key = ?1",
                params![&key.0[..]],
                |r| {
                    Ok(CachedAnswer {
                        raw: r.get(0)?,
                        parsed: r.get(1)?,
                    })
                },
            )
            .optional();
        match row {
            Ok(Some(a)) => {
                self.hits.fetch_add(1, Ordering::Relaxed);
                Some(a)
            }
            Ok(None) => {
                self.misses.fetch_add(1, Ordering::Relaxed);
                None
            }
            Err(_) => {
                self.errors.fetch_add(1, Ordering::Relaxed);
                self.misses.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }

    /// Stores an answer (replacing an older one with the same key).
    pub fn put(&self, key: &CacheKey, judge: &str, kind: &str, answer: &CachedAnswer) {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        let r = conn.execute(
            "INSERT OR REPLACE INTO judge_cache (key, judge, kind, raw, parsed, created_unix) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            params![&key.0[..], judge, kind, &answer.raw, &answer.parsed, now as i64],
        );
        match r {
            Ok(_) => self.writes.fetch_add(1, Ordering::Relaxed),
            Err(_) => self.errors.fetch_add(1, Ordering::Relaxed),
        };
    }

    /// Looks a key up and deserialises the stored answer; `(answer, raw output)`.
    pub fn get_parsed<T: serde::de::DeserializeOwned>(
        &self,
        key: &CacheKey,
    ) -> Option<(T, String)> {
        let hit = self.get(key)?;
        serde_json::from_str(&hit.parsed).ok().map(|v| (v, hit.raw))
    }

    /// Stores a parsed answer with the raw output it came from.
    pub fn put_parsed<T: serde::Serialize>(
        &self,
        key: &CacheKey,
        judge: &str,
        kind: &str,
        answer: &T,
        raw: &str,
    ) {
        match serde_json::to_string(answer) {
            Ok(parsed) => self.put(
                key,
                judge,
                kind,
                &CachedAnswer {
                    raw: raw.to_string(),
                    parsed,
                },
            ),
            Err(_) => {
                self.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Stores a criterion verdict's labels with the request they grade, so that a probe can later
    /// be distilled from the cache (`conrub judge distill --cache`): both rows in one transaction.
    pub fn put_criteria(
        &self,
        key: &CacheKey,
        judge: &str,
        request: &CriterionRequest,
        labels: &[conrub_rubric::Label],
        raw: &str,
    ) {
        let (Ok(parsed), Ok(req)) = (
            serde_json::to_string(labels),
            serde_json::to_string(request),
        ) else {
            self.errors.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let mut conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        let r = (|| {
            let tx = conn.transaction()?;
            tx.execute(
                "INSERT OR REPLACE INTO judge_cache (key, judge, kind, raw, parsed, created_unix) VALUES (?1, ?2, 'criteria', ?3, ?4, ?5)",
                params![&key.0[..], judge, raw, &parsed, now as i64],
            )?;
            tx.execute(
                "INSERT OR REPLACE INTO criterion_requests (key, request) VALUES (?1, ?2)",
                params![&key.0[..], &req],
            )?;
            tx.commit()
        })();
        match r {
            Ok(_) => self.writes.fetch_add(1, Ordering::Relaxed),
            Err(_) => self.errors.fetch_add(1, Ordering::Relaxed),
        };
    }

    /// Every criterion verdict stored with its request (see [`JudgeCache::put_criteria`]), in key
    /// order: `(judge, request, labels)`. Verdicts stored without their request (by an older
    /// conrub) are counted in the second value, not returned.
    pub fn criterion_verdicts(
        &self,
    ) -> Result<(
        Vec<(
            String,
            crate::judge::CriterionRequest,
            Vec<conrub_rubric::Label>,
        )>,
        u64,
    )> {
        let err = |e: rusqlite::Error| JudgeError::Cache {
            path: self.path.clone(),
            source: e,
        };
        let conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        let mut stmt = conn
            .prepare(
                "SELECT c.judge, c.parsed, r.request FROM judge_cache c
                 LEFT JOIN criterion_requests r ON r.key = c.key
                 WHERE c.kind = 'criteria' ORDER BY c.key",
            )
            .map_err(err)?;
        let rows = stmt
            .query_map([], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, Option<String>>(2)?,
                ))
            })
            .map_err(err)?;
        let (mut out, mut bare) = (Vec::new(), 0);
        for row in rows {
            let (judge, parsed, request) = row.map_err(err)?;
            let Some(request) = request else {
                bare += 1;
                continue;
            };
            let bad = |what: &str, e: serde_json::Error| JudgeError::Parse {
                path: self.path.clone(),
                message: format!("a stored {what} does not parse: {e}"),
            };
            let request = serde_json::from_str(&request).map_err(|e| bad("request", e))?;
            let labels = serde_json::from_str(&parsed).map_err(|e| bad("label list", e))?;
            out.push((judge, request, labels));
        }
        Ok((out, bare))
    }

    /// Number of stored answers.
    pub fn len(&self) -> Result<u64> {
        let conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        conn.query_row("SELECT COUNT(*) FROM judge_cache", [], |r| {
            r.get::<_, i64>(0)
        })
        .map(|n| n as u64)
        .map_err(|e| JudgeError::Cache {
            path: self.path.clone(),
            source: e,
        })
    }

    /// True when nothing is stored.
    pub fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }

    /// Counters since opening.
    pub fn stats(&self) -> CacheStats {
        CacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            writes: self.writes.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(i: usize) -> CachedAnswer {
        CachedAnswer {
            raw: format!("raw {i}"),
            parsed: format!("[\"{i}\"]"),
        }
    }

    #[test]
    fn keys_separate_parts() {
        assert_ne!(CacheKey::of(&["ab", "c"]), CacheKey::of(&["a", "bc"]));
        assert_eq!(CacheKey::of(&["x", "y"]), CacheKey::of(&["x", "y"]));
    }

    #[test]
    fn concurrent_writers_in_separate_connections_lose_nothing() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("sub/cache.sqlite");
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let path = path.clone();
                std::thread::spawn(move || {
                    let c = JudgeCache::open(&path).unwrap();
                    for i in 0..150 {
                        c.put(
                            &CacheKey::of(&[&t.to_string(), &i.to_string()]),
                            "m",
                            "criteria",
                            &answer(i),
                        );
                    }
                    c.stats()
                })
            })
            .collect();
        for t in threads {
            let s = t.join().unwrap();
            assert_eq!((s.writes, s.errors), (150, 0));
        }
        let c = JudgeCache::open(&path).unwrap();
        assert_eq!(c.len().unwrap(), 600);
        assert_eq!(c.get(&CacheKey::of(&["3", "149"])), Some(answer(149)));
        assert_eq!(c.get(&CacheKey::of(&["4", "0"])), None);
        assert_eq!(c.stats().hits, 1);
    }

    #[test]
    fn committed_answers_survive_an_unclean_exit() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("cache.sqlite");
        let c = JudgeCache::open(&path).unwrap();
        c.put(&CacheKey::of(&["k"]), "m", "criteria", &answer(1));
        // No close, no checkpoint: the answer lives only in the write-ahead log, as after a crash.
        std::mem::forget(c);
        let again = JudgeCache::open(&path).unwrap();
        assert_eq!(again.get(&CacheKey::of(&["k"])), Some(answer(1)));
    }
}
