//! The connection under hyper: protocol-level errors get the API's JSON error body.
//!
//! hyper answers a request it cannot parse (a head over its buffer: 431; a bad
//! `content-length`, a malformed request line: 400; a URI too long: 414) by itself, before any
//! handler runs, with an empty body. [`JsonErrors`] wraps the TCP stream and rewrites exactly
//! those responses, as they are written, into the `{"error": {"message", "type", "code"}}`
//! shape every other error of this server has. Nothing else is touched: a write is rewritten
//! only when it is a whole `HTTP/1.1 4xx` head with `content-length: 0`, which no handler of
//! this server produces (every handler error carries its JSON body).

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// A stream whose hyper-made empty 4xx responses get the JSON error body (module doc).
pub struct JsonErrors<S> {
    inner: S,
    /// A rewritten response still being written, and how much of it is out.
    pending: Option<(Vec<u8>, usize)>,
}

impl<S> JsonErrors<S> {
    pub fn new(inner: S) -> Self {
        JsonErrors {
            inner,
            pending: None,
        }
    }
}

/// The JSON error response for an empty `HTTP/1.1 4xx` head `head`, or `None` when `head` is
/// anything else.
fn rewrite(head: &[u8]) -> Option<Vec<u8>> {
    let text = std::str::from_utf8(head).ok()?;
    let rest = text.strip_prefix("HTTP/1.1 4")?;
    if !text.ends_with("\r\n\r\n") {
        return None;
    }
    let status: u16 = text.get(9..12)?.parse().ok()?;
    let (first, headers) = text.split_once("\r\n")?;
    let mut kept = Vec::new();
    let mut empty = false;
    for h in headers.trim_end_matches("\r\n").split("\r\n") {
        if h.eq_ignore_ascii_case("content-length: 0") {
            empty = true;
        } else if !h.is_empty() {
            kept.push(h);
        }
    }
    if !empty || rest.is_empty() {
        return None;
    }
    let reason = first.get(13..).unwrap_or("").trim();
    let (message, code) = match status {
        431 => (
            "the request head is larger than this server reads".to_string(),
            "request_header_fields_too_large",
        ),
        414 => ("the request URI is too long".to_string(), "uri_too_long"),
        400 => (
            "malformed HTTP request (request line, a header, content-length or chunked framing)"
                .to_string(),
            "bad_request",
        ),
        _ => (format!("HTTP error: {reason}"), "http_error"),
    };
    let body = serde_json::json!({"error": {"message": message, "type": "invalid_request_error", "code": code}})
        .to_string();
    let mut out = format!(
        "{first}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n",
        body.len()
    );
    for h in kept {
        out.push_str(h);
        out.push_str("\r\n");
    }
    out.push_str("\r\n");
    out.push_str(&body);
    Some(out.into_bytes())
}

impl<S: AsyncWrite + Unpin> JsonErrors<S> {
    /// Writes out what is left of a rewritten response.
    fn poll_pending(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while let Some((buf, done)) = &mut self.pending {
            if *done == buf.len() {
                self.pending = None;
                break;
            }
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &buf[*done..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            *done += n;
        }
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for JsonErrors<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for JsonErrors<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        ready!(self.poll_pending(cx))?;
        if let Some(out) = rewrite(buf) {
            // taken whole: the caller's bytes count as written once the rewrite is queued
            self.pending = Some((out, 0));
            let _ = self.poll_pending(cx)?;
            return Poll::Ready(Ok(buf.len()));
        }
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_pending(cx))?;
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_pending(cx))?;
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    // hyper then writes each response as one flattened buffer, so a head is never split
    // across the slices of a vectored write
    fn is_write_vectored(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::rewrite;

    #[test]
    fn only_empty_4xx_heads_are_rewritten() {
        let h =
            b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\ndate: x\r\n\r\n";
        let out = String::from_utf8(rewrite(h).unwrap()).unwrap();
        assert!(
            out.starts_with("HTTP/1.1 431 Request Header Fields Too Large\r\n"),
            "{out}"
        );
        let (head, body) = out.split_once("\r\n\r\n").unwrap();
        assert!(head.contains("content-type: application/json"));
        assert!(head.contains(&format!("content-length: {}", body.len())));
        assert!(head.contains("date: x"));
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["code"], "request_header_fields_too_large");
        // a response with a body, a 2xx, a partial head: untouched
        assert!(rewrite(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 17\r\n\r\n").is_none());
        assert!(rewrite(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").is_none());
        assert!(rewrite(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n").is_none());
    }
}
