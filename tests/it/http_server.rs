//! A tiny threaded HTTP/1.1 file server on 127.0.0.1:0 for the download tests. It serves
//! in-memory files with Range support and can be told to cut the next body short, answer
//! slowly, ignore Range, or redirect a path. It records every request head. It speaks HTTPS
//! too (rustls, with a certificate the test makes), and `ConnectProxy` is a CONNECT proxy
//! that records what it was asked to reach.

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
    /// path -> Location answered with 302 Found.
    pub redirects: HashMap<String, String>,
}

/// A connection the server answers on: plain TCP or TLS over it.
trait Conn: Read + Write + Send + 'static {
    fn close(&mut self);
}

impl Conn for TcpStream {
    fn close(&mut self) {
        let _ = self.shutdown(std::net::Shutdown::Both);
    }
}

impl Conn for rustls::StreamOwned<rustls::ServerConnection, TcpStream> {
    fn close(&mut self) {
        self.conn.send_close_notify();
        let _ = self.flush();
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
    }
}

pub struct Server {
    pub addr: SocketAddr,
    pub state: Arc<Mutex<State>>,
    scheme: &'static str,
}

impl Server {
    pub fn start() -> Server {
        Server::listen(None)
    }

    /// An HTTPS server with this certificate chain and key (PEM).
    pub fn start_tls(cert_pem: &str, key_pem: &str) -> Server {
        use rustls::pki_types::{pem::PemObject, CertificateDer, PrivateKeyDer};
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem.as_bytes()).map(|c| c.unwrap()).collect();
        let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).unwrap();
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .unwrap();
        Server::listen(Some(Arc::new(config)))
    }

    fn listen(tls: Option<Arc<rustls::ServerConfig>>) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(Mutex::new(State::default()));
        let st = state.clone();
        let scheme = if tls.is_some() { "https" } else { "http" };
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                let st = st.clone();
                let tls = tls.clone();
                std::thread::spawn(move || {
                    let _ = match tls {
                        Some(cfg) => rustls::ServerConnection::new(cfg).map_err(std::io::Error::other).and_then(|c| handle(rustls::StreamOwned::new(c, stream), &st)),
                        None => handle(stream, &st),
                    };
                });
            }
        });
        Server { addr, state, scheme }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}://{}{path}", self.scheme, self.addr)
    }

    /// The url with `host` (e.g. `localhost`) instead of the address.
    pub fn url_at(&self, host: &str, path: &str) -> String {
        format!("{}://{host}:{}{path}", self.scheme, self.addr.port())
    }

    pub fn redirect(&self, path: &str, location: &str) {
        self.state.lock().unwrap().redirects.insert(path.into(), location.into());
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

/// A request head, up to its blank line (None when the peer closes first).
fn read_head(s: &mut impl Read) -> std::io::Result<Option<String>> {
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if s.read(&mut b)? == 0 {
            return Ok(None);
        }
        head.push(b[0]);
    }
    Ok(Some(String::from_utf8_lossy(&head).to_string()))
}

fn handle(mut s: impl Conn, st: &Mutex<State>) -> std::io::Result<()> {
    let Some(head) = read_head(&mut s)? else { return Ok(()) };
    let target = head.split_whitespace().nth(1).unwrap_or("/");
    // the absolute form (`GET https://host/path`), which servers must accept and ureq sends
    // through a proxy's tunnel, names the same path
    let path = match target.split_once("://") {
        Some((_, rest)) => rest.find('/').map_or("/", |i| &rest[i..]).to_string(),
        None => target.to_string(),
    };
    let range_start = head
        .lines()
        .find_map(|l| l.to_ascii_lowercase().strip_prefix("range: bytes=").map(|r| r.trim().trim_end_matches('-').to_string()))
        .and_then(|r| r.parse::<usize>().ok());
    let (file, drop_after, delay, ignore_range, redirect) = {
        let mut g = st.lock().unwrap();
        g.requests.push(head.clone());
        (g.files.get(&path).cloned(), g.drop_after.take(), g.delay, g.ignore_range, g.redirects.get(&path).cloned())
    };
    if let Some(d) = delay {
        std::thread::sleep(d);
    }
    if let Some(location) = redirect {
        write!(s, "HTTP/1.1 302 Found\r\nLocation: {location}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")?;
        s.close();
        return Ok(());
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
            s.close();
        }
        None => {
            s.write_all(body)?;
            s.flush()?;
            s.close();
        }
    }
    Ok(())
}

/// A private CA and a server certificate it signed for `127.0.0.1` and `localhost`, as PEM:
/// (CA certificate, server certificate, server key).
pub fn private_ca() -> (String, String, String) {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name.push(DnType::CommonName, "scfoundry test CA");
    let ca = ca.self_signed(&ca_key).unwrap();
    let key = KeyPair::generate().unwrap();
    let mut leaf = CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()]).unwrap();
    leaf.distinguished_name.push(DnType::CommonName, "127.0.0.1");
    let leaf = leaf.signed_by(&key, &ca, &ca_key).unwrap();
    (ca.pem(), leaf.pem(), key.serialize_pem())
}

/// A loopback HTTP CONNECT proxy that records each request line and tunnels the bytes.
pub struct ConnectProxy {
    pub addr: SocketAddr,
    pub seen: Arc<Mutex<Vec<String>>>,
}

impl ConnectProxy {
    pub fn start() -> ConnectProxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                let log = log.clone();
                std::thread::spawn(move || {
                    let _ = tunnel(stream, &log);
                });
            }
        });
        ConnectProxy { addr, seen }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn seen(&self) -> Vec<String> {
        self.seen.lock().unwrap().clone()
    }
}

fn tunnel(mut client: TcpStream, log: &Mutex<Vec<String>>) -> std::io::Result<()> {
    let Some(head) = read_head(&mut client)? else { return Ok(()) };
    let line = head.lines().next().unwrap_or_default().to_string();
    log.lock().unwrap().push(line.clone());
    let mut words = line.split_whitespace();
    let (Some("CONNECT"), Some(target)) = (words.next(), words.next()) else {
        client.write_all(b"HTTP/1.1 405 Method Not Allowed\r\nContent-Length: 0\r\n\r\n")?;
        return Ok(());
    };
    let upstream = TcpStream::connect(target)?;
    client.write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")?;
    let (mut c2, mut u2) = (client.try_clone()?, upstream.try_clone()?);
    let up = std::thread::spawn(move || {
        let _ = std::io::copy(&mut c2, &mut u2);
        let _ = u2.shutdown(std::net::Shutdown::Write);
    });
    let mut upstream = upstream;
    let _ = std::io::copy(&mut upstream, &mut client);
    let _ = client.shutdown(std::net::Shutdown::Write);
    let _ = up.join();
    Ok(())
}
