//! A tiny threaded HTTP/1.1 file server on 127.0.0.1:0 for the download tests. It serves
//! in-memory files with Range support and can be told to cut the next body short, answer
//! slowly, or ignore Range. It records every request head.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Default)]
pub struct State {
    pub files: HashMap<String, Vec<u8>>,
    /// Cut the next response body after this many bytes, then close (one-shot).
    pub drop_after: Option<usize>,
    /// Wait this long before answering each request.
    pub delay: Option<Duration>,
    /// Answer 200 with the whole file even when asked for a range.
    pub ignore_range: bool,
    /// Request heads received, in order.
    pub requests: Vec<String>,
}

pub struct Server {
    pub addr: SocketAddr,
    pub state: Arc<Mutex<State>>,
}

impl Server {
    pub fn start() -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(Mutex::new(State::default()));
        let st = state.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                let st = st.clone();
                std::thread::spawn(move || {
                    let _ = handle(stream, &st);
                });
            }
        });
        Server { addr, state }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub fn serve(&self, path: &str, body: Vec<u8>) {
        self.state.lock().unwrap().files.insert(path.into(), body);
    }

    pub fn requests(&self) -> Vec<String> {
        self.state.lock().unwrap().requests.clone()
    }
}

/// A loopback port with nothing listening (bound, then released).
pub fn closed_port_url(path: &str) -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    drop(l);
    format!("http://{addr}{path}")
}

fn handle(mut s: TcpStream, st: &Mutex<State>) -> std::io::Result<()> {
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if s.read(&mut b)? == 0 {
            return Ok(());
        }
        head.push(b[0]);
    }
    let head = String::from_utf8_lossy(&head).to_string();
    let path = head.split_whitespace().nth(1).unwrap_or("/").to_string();
    let range_start = head
        .lines()
        .find_map(|l| l.to_ascii_lowercase().strip_prefix("range: bytes=").map(|r| r.trim().trim_end_matches('-').to_string()))
        .and_then(|r| r.parse::<usize>().ok());
    let (file, drop_after, delay, ignore_range) = {
        let mut g = st.lock().unwrap();
        g.requests.push(head.clone());
        (g.files.get(&path).cloned(), g.drop_after.take(), g.delay, g.ignore_range)
    };
    if let Some(d) = delay {
        std::thread::sleep(d);
    }
    let Some(file) = file else {
        let body = b"not found";
        write!(s, "HTTP/1.1 404 Not Found\r\nContent-Length: {}\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n", body.len())?;
        s.write_all(body)?;
        return Ok(());
    };
    let len = file.len();
    let (status, start) = match range_start {
        Some(n) if !ignore_range && n >= len => {
            write!(s, "HTTP/1.1 416 Range Not Satisfiable\r\nContent-Range: bytes */{len}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")?;
            return Ok(());
        }
        Some(n) if !ignore_range => ("206 Partial Content", n),
        _ => ("200 OK", 0),
    };
    let body = &file[start..];
    let mut h = format!("HTTP/1.1 {status}\r\nContent-Type: application/octet-stream\r\nContent-Length: {}\r\nAccept-Ranges: bytes\r\nConnection: close\r\n", body.len());
    if start > 0 {
        h += &format!("Content-Range: bytes {start}-{}/{len}\r\n", len - 1);
    }
    h += "\r\n";
    s.write_all(h.as_bytes())?;
    match drop_after {
        Some(n) => {
            s.write_all(&body[..n.min(body.len())])?;
            s.flush()?;
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        None => s.write_all(body)?,
    }
    Ok(())
}
