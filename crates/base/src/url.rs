//! URLs as conrub shows them and as it calls them. A server's URL may carry a secret (a user and
//! password, an `api_key=` in the query); [`shown_url`] is the one form any message, log line,
//! sample file or manifest gets, and [`endpoint`] appends an API path without breaking a query.

/// `url` without what may be a secret: the user and password before `@`, the query and the
/// fragment. What is left names the server and its path (`http://host:8000/v1`).
pub fn shown_url(url: &str) -> String {
    let (base, _) = split_query(url);
    match base.find("://") {
        Some(i) => {
            let (scheme, rest) = (&base[..i + 3], &base[i + 3..]);
            let authority_end = rest.find('/').unwrap_or(rest.len());
            let host_from = rest[..authority_end].rfind('@').map_or(0, |a| a + 1);
            format!("{scheme}{}", &rest[host_from..])
        }
        // Not a URL: drop everything after a `@` anyway.
        None => base.rsplit('@').next().unwrap_or_default().to_string(),
    }
}

/// `url` with `path` appended to its path, its query (if any) kept after it:
/// `endpoint("http://h/v1?key=K", "/chat/completions")` is `http://h/v1/chat/completions?key=K`.
pub fn endpoint(url: &str, path: &str) -> String {
    let (base, query) = split_query(url);
    let base = base.trim_end_matches('/');
    let path = path.trim_start_matches('/');
    format!("{base}/{path}{query}")
}

/// `url` before its query or fragment, and that tail (with its `?` or `#`).
fn split_query(url: &str) -> (&str, &str) {
    let cut = url.find(['?', '#']).unwrap_or(url.len());
    url.split_at(cut)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_never_show() {
        let cases = [
            (
                "http://user:pass@host:8000/v1?api_key=K#f",
                "http://host:8000/v1",
            ),
            (
                "https://tok@api.example.com/v1",
                "https://api.example.com/v1",
            ),
            ("http://host/v1", "http://host/v1"),
            ("http://host/a@b/v1", "http://host/a@b/v1"),
            ("http://u:p@w@host", "http://host"),
            ("host?key=K", "host"),
        ];
        for (url, shown) in cases {
            assert_eq!(shown_url(url), shown, "{url}");
        }
    }

    #[test]
    fn a_path_goes_before_the_query() {
        assert_eq!(
            endpoint("http://h/v1?api_key=K", "/chat/completions"),
            "http://h/v1/chat/completions?api_key=K"
        );
        assert_eq!(
            endpoint("http://h/v1/", "chat/completions"),
            "http://h/v1/chat/completions"
        );
        assert_eq!(endpoint("http://h", "/generate"), "http://h/generate");
    }
}
