//! Hashes this crate's sources into `CONRUB_KERNELS_SOURCE_HASH` (FNV-1a 64 over every file
//! under `src/` and `Cargo.toml`, paths and contents, in path order): the kernel cache's build
//! key (`kernel_cache.rs`), so a changed kernel never reads a compiled entry of the old one.

use std::path::{Path, PathBuf};

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            files(&p, out);
        } else {
            out.push(p);
        }
    }
}

fn fnv1a(hash: &mut u64, bytes: &[u8]) {
    for b in bytes {
        *hash ^= u64::from(*b);
        *hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
}

fn main() {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let mut all = vec![root.join("Cargo.toml")];
    files(&root.join("src"), &mut all);
    all.sort();
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    for p in &all {
        let rel = p.strip_prefix(&root).unwrap_or(p);
        fnv1a(&mut hash, rel.to_string_lossy().as_bytes());
        fnv1a(&mut hash, &std::fs::read(p).unwrap_or_default());
    }
    println!("cargo:rustc-env=CONRUB_KERNELS_SOURCE_HASH={hash:016x}");
    println!("cargo:rerun-if-changed=src");
    println!("cargo:rerun-if-changed=Cargo.toml");
}
