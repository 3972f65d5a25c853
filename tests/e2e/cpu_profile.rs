//! What of the CPU changes conrub's CPU numbers, for the demo's goldens.
//!
//! burn-flex's f32 results depend on the machine in two places (found with an AVX-512 mask and
//! a faked L1 cache on one machine; see tests/golden/README.md):
//! - the SIMD width its reductions (`sum`, `mean`, RMSNorm's mean, the softmax backward's row
//!   sums) run at, chosen at run time by `macerator`: 16 f32 lanes with AVX-512, 8 with AVX2, so
//!   the partial sums are added in another order;
//! - the k-block of `gemm`'s matmul, sized at run time from the L1 data cache (size, ways, line):
//!   a product over more than one block adds the blocks' partial sums, so 32 KiB 8-way and
//!   48 KiB 12-way caches split the demo's weight-gradient products differently;
//! - the number of threads: conrub's fused CPU head splits the vocabulary over
//!   `available_parallelism` threads, and burn-flex splits its largest sums over rayon's.
//!
//! A profile names all three; two machines of one profile write the same numbers.

/// The profile of this machine, as a golden's file name: `avx512-l1d-48K-12way-64B-2cpu`.
pub fn key() -> String {
    let l1d = l1_data_cache().unwrap_or_else(|| "l1d-unknown".into());
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    format!("{}-{l1d}-{cpus}cpu", simd())
}

/// The widest SIMD level macerator 0.3 picks on this CPU (its `V4` needs AVX-512 F, BW, CD, DQ
/// and VL; `V3` AVX2 and FMA).
fn simd() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx512f")
            && has!("avx512bw")
            && has!("avx512cd")
            && has!("avx512dq")
            && has!("avx512vl")
        {
            return "avx512";
        }
        if has!("avx2") && has!("fma") {
            return "avx2";
        }
        "sse"
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        std::env::consts::ARCH
    }
}

/// CPU 0's level-1 data cache as Linux reports it (what gemm sizes its blocks from):
/// `l1d-48K-12way-64B`.
fn l1_data_cache() -> Option<String> {
    let dir = std::path::Path::new("/sys/devices/system/cpu/cpu0/cache");
    std::fs::read_dir(dir).ok()?.flatten().find_map(|e| {
        let read = |f: &str| std::fs::read_to_string(e.path().join(f)).ok();
        let is_l1d = read("level")?.trim() == "1" && read("type")?.trim() == "Data";
        is_l1d.then(|| {
            let size = read("size")?;
            let ways = read("ways_of_associativity")?;
            let line = read("coherency_line_size")?;
            Some(format!(
                "l1d-{}-{}way-{}B",
                size.trim(),
                ways.trim(),
                line.trim()
            ))
        })?
    })
}
