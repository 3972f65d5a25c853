//! Hub downloads through `hf-hub` against a loopback server standing in for the Hugging Face hub
//! (`HF_ENDPOINT`): files are fetched into the cache (`HF_HOME`) with the `HF_TOKEN` bearer token,
//! the model loads with the same logits as from the local directory, and a second load is served
//! from the cache without a single request. Its own test binary, since it sets process-wide
//! environment variables.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use burn::tensor::DType;
use conrub_models::{ForwardBatch, Pretrained};

type B = burn::backend::Flex;

const REPO: &str = "acme/tiny-qwen3";
const TOKEN: &str = "hf_test_token";

fn testdata(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("testdata/qwen3")
        .join(name)
}

/// Serves `dir` as `/{REPO}/resolve/main/{file}`; counts requests; needs `Authorization: Bearer TOKEN`.
fn serve(dir: PathBuf, requests: Arc<AtomicUsize>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        // Bounded: the test needs a handful of requests.
        for stream in listener.incoming().take(64).flatten() {
            requests.fetch_add(1, Ordering::SeqCst);
            let _ = handle(stream, &dir);
        }
    });
    format!("http://{addr}")
}

fn handle(mut stream: TcpStream, dir: &Path) -> std::io::Result<()> {
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
    let (mut range, mut auth) = (None, None);
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h)? == 0 || h == "\r\n" {
            break;
        }
        let (name, value) = h.split_once(':').unwrap_or((&h, ""));
        match name.to_ascii_lowercase().as_str() {
            "range" => range = Some(value.trim().to_string()),
            "authorization" => auth = Some(value.trim().to_string()),
            _ => {}
        }
    }
    let reply = |stream: &mut TcpStream, status: &str, headers: String, body: &[u8]| {
        write!(
            stream,
            "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n{headers}\r\n",
            body.len()
        )?;
        stream.write_all(body)
    };
    if auth.as_deref() != Some(&format!("Bearer {TOKEN}")) {
        return reply(&mut stream, "401 Unauthorized", String::new(), b"");
    }
    let prefix = format!("/{REPO}/resolve/main/");
    let file = path.strip_prefix(&prefix).map(|f| dir.join(f));
    let Some(Ok(mut f)) = file.map(std::fs::File::open) else {
        return reply(&mut stream, "404 Not Found", String::new(), b"");
    };
    let mut data = Vec::new();
    f.read_to_end(&mut data)?;
    let size = data.len();
    let start: usize = range
        .as_deref()
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.split('-').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let end = match range.as_deref() {
        Some("bytes=0-0") => 1,
        _ => size,
    };
    let headers = format!(
        "x-repo-commit: 0123456789abcdef0123456789abcdef01234567\r\netag: \"{size:x}-etag\"\r\nContent-Range: bytes {start}-{}/{size}\r\n",
        end.saturating_sub(1)
    );
    reply(
        &mut stream,
        "206 Partial Content",
        headers,
        &data[start..end],
    )
}

fn last_logits(q: &Pretrained<B>) -> Vec<f32> {
    let batch = ForwardBatch::<B>::contiguous(&[vec![3, 1, 4, 1, 5, 9]], 0, &Default::default());
    q.model
        .forward(&batch)
        .cast(DType::F32)
        .into_data()
        .convert::<f32>()
        .into_vec()
        .unwrap()
}

#[test]
fn hub_download_then_cache() {
    let home = tempfile::tempdir().unwrap();
    let requests = Arc::new(AtomicUsize::new(0));
    let endpoint = serve(testdata("tied-gqa-f32"), requests.clone());
    // SAFETY: the only test in this binary; nothing else reads the environment concurrently.
    unsafe {
        std::env::set_var("HF_HOME", home.path());
        std::env::set_var("HF_ENDPOINT", &endpoint);
        std::env::remove_var("HF_HUB_OFFLINE");
    }

    // Without the token the server refuses, and the error says what to do.
    unsafe { std::env::remove_var("HF_TOKEN") };
    let err = Pretrained::<B>::load(REPO, &Default::default())
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains(REPO) && err.contains("HF_TOKEN"), "{err}");

    unsafe { std::env::set_var("HF_TOKEN", TOKEN) };
    let downloaded = Pretrained::<B>::load(REPO, &Default::default()).unwrap();
    assert!(
        downloaded.dir.starts_with(home.path()),
        "{:?}",
        downloaded.dir
    );
    let local = Pretrained::<B>::load_dir(&testdata("tied-gqa-f32"), &Default::default()).unwrap();
    assert_eq!(last_logits(&downloaded), last_logits(&local));

    // Second load: everything is cached, no request reaches the server.
    let before = requests.load(Ordering::SeqCst);
    assert!(before > 0);
    let cached = Pretrained::<B>::load(REPO, &Default::default()).unwrap();
    assert_eq!(requests.load(Ordering::SeqCst), before);
    assert_eq!(last_logits(&cached), last_logits(&local));
}
