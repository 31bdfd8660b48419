//! The launcher's key-value store: the rendezvous of a job `torchrun` started.
//!
//! `torchrun` starts its workers without MPI; what it gives them to meet through is the store
//! its agent serves at `MASTER_ADDR:MASTER_PORT` (`TORCHELASTIC_USE_AGENT_STORE=True`): PyTorch's
//! `TCPStore`, which `init_process_group("env://")` joins. megatrain joins it the same way, as a
//! client speaking its protocol (PyTorch's `torch/csrc/distributed/c10d/TCPStore.cpp` and
//! `TCPStoreBackend.hpp`; tested against the `torchrun` of the PyTorch
//! `tools/setup-torchrun.sh` installs), and uses it for what NCCL leaves to the program: moving
//! rank 0's unique id to the other ranks, and the ranks' host names. Everything else goes
//! through NCCL.
//!
//! The protocol: a query is one byte (its type) and its arguments; a string or byte vector is
//! its length as a native-endian `u64`, then its bytes; a number is a native-endian `i64`. A
//! connection opens with `VALIDATE` and the store's magic number. `SET key value` has no
//! answer; `WAIT n key…` answers one byte once every key is set; `MULTI_GET n key…` answers
//! each value (of keys that are set). Keys carry PyTorch's `/` prefix, as its own clients' do.
//!
//! The store is torchrun's agent's only where torchrun says so
//! (`TORCHELASTIC_USE_AGENT_STORE=True`, as PyTorch 2.15's does for every rendezvous); where it
//! does not, rank 0 would be expected to serve one, which megatrain does not: refused with the
//! reason.

use crate::{Error, Result};
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// The store's magic number (`validationMagicNumber`).
const MAGIC: u32 = 0x3C85_F7CE;

/// Query types (`QueryType`), in PyTorch's order.
#[derive(Clone, Copy)]
#[repr(u8)]
enum Query {
    Validate = 0,
    Set = 1,
    Wait = 6,
    MultiGet = 10,
}

/// `WAIT`'s answer once every key is set (`WaitResponseType::STOP_WAITING`).
const STOP_WAITING: u8 = 0;

/// The largest value megatrain reads from the store (its values are ids and host names): a
/// longer length is a protocol mismatch, refused before anything is allocated.
const MAX_VALUE: u64 = 1 << 20;

/// Where the launcher's store is, and the keys of this attempt of this job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreAddress {
    /// `MASTER_ADDR`.
    pub host: String,
    /// `MASTER_PORT`.
    pub port: u16,
    /// Every key this job sets starts with it: the run (`TORCHELASTIC_RUN_ID`) and the attempt
    /// (`TORCHELASTIC_RESTART_COUNT`), so a restarted job never reads a dead attempt's values.
    pub prefix: String,
}

impl StoreAddress {
    /// From the variables `torchrun` sets for its workers (`var` looks them up).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<StoreAddress> {
        let missing = |name: &str| {
            Error::bad_input(
                "launch environment",
                name.to_owned(),
                "is not set: a job with RANK and WORLD_SIZE meets at the store MASTER_ADDR:MASTER_PORT names, which torchrun sets",
                Some("start the job with `torchrun --nproc-per-node N --no-python megatrain train …`, or with mpirun/srun"),
            )
        };
        let host = var("MASTER_ADDR").ok_or_else(|| missing("MASTER_ADDR"))?;
        let port_s = var("MASTER_PORT").ok_or_else(|| missing("MASTER_PORT"))?;
        let port = port_s.trim().parse::<u16>().map_err(|_| {
            Error::bad_input(
                "launch environment",
                format!("MASTER_PORT={port_s}"),
                "is not a port number (1 to 65535)",
                Some("start megatrain from torchrun itself, without overriding its variables"),
            )
        })?;
        let agent = var("TORCHELASTIC_USE_AGENT_STORE");
        if agent.as_deref() != Some("True") {
            return Err(Error::bad_input(
                "launch environment",
                format!(
                    "TORCHELASTIC_USE_AGENT_STORE={}",
                    agent.as_deref().unwrap_or("(not set)")
                ),
                "torchrun serves its workers a store only where it sets this to True; otherwise rank 0 is expected to serve one, which megatrain does not",
                Some("use a PyTorch whose torchrun sets it (2.15 is tested), or start the job with mpirun or srun"),
            ));
        }
        let run = var("TORCHELASTIC_RUN_ID").unwrap_or_else(|| "none".into());
        let attempt = var("TORCHELASTIC_RESTART_COUNT").unwrap_or_else(|| "0".into());
        Ok(StoreAddress {
            host: host.trim().to_owned(),
            port,
            prefix: format!("/megatrain/{run}/{attempt}/"),
        })
    }

    /// From this process's environment.
    pub fn from_env() -> Result<StoreAddress> {
        Self::from_vars(|k| std::env::var(k).ok())
    }
}

/// A connection to the launcher's store.
#[derive(Debug)]
pub struct Store {
    sock: TcpStream,
    address: StoreAddress,
    /// How long a wait for a key, or a connection, may take.
    timeout: Duration,
}

impl Store {
    /// Connect to the store at `address`, trying again until `timeout` (the agent of another
    /// node may open it after this worker starts), and validate the connection.
    pub fn connect(address: &StoreAddress, timeout: Duration) -> Result<Store> {
        let t0 = Instant::now();
        let target = address.to_string();
        let failed = |why: String| {
            Error::system(
                "launcher store",
                format!("connect to torchrun's store at {target}"),
                why,
            )
            .with_fix("check MASTER_ADDR and MASTER_PORT (torchrun sets them) and that this host reaches that address")
        };
        let sock = loop {
            let tried = (address.host.as_str(), address.port)
                .to_socket_addrs()
                .map_err(|e| e.to_string())
                .and_then(|addrs| {
                    let mut last = format!("{target} resolves to no address");
                    for a in addrs {
                        match TcpStream::connect_timeout(&a, Duration::from_secs(5)) {
                            Ok(s) => return Ok(s),
                            Err(e) => last = e.to_string(),
                        }
                    }
                    Err(last)
                });
            match tried {
                Ok(s) => break s,
                Err(why) if t0.elapsed() >= timeout => {
                    return Err(failed(format!("{why} (tried for {} s)", timeout.as_secs())))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(200)),
            }
        };
        sock.set_nodelay(true)
            .and_then(|()| sock.set_write_timeout(Some(timeout)))
            .map_err(|e| failed(e.to_string()))?;
        let mut s = Store {
            sock,
            address: address.clone(),
            timeout,
        };
        let mut q = vec![Query::Validate as u8];
        q.extend_from_slice(&MAGIC.to_ne_bytes());
        s.send(&q, "validate the connection")?;
        Ok(s)
    }

    fn io_error(&self, what: &str, e: std::io::Error) -> Error {
        let why = match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => format!(
                "no answer within {} s: a rank that never reached the store (it failed or never started: torchrun's log says), or a store that is not PyTorch's",
                self.timeout.as_secs()
            ),
            std::io::ErrorKind::UnexpectedEof => {
                "the store closed the connection (torchrun's agent ended, or it refused the query)"
                    .to_owned()
            }
            _ => e.to_string(),
        };
        Error::system(
            "launcher store",
            format!("{what} (torchrun's store at {})", self.address),
            why,
        )
    }

    fn send(&mut self, bytes: &[u8], what: &str) -> Result<()> {
        self.sock
            .write_all(bytes)
            .map_err(|e| self.io_error(what, e))
    }

    fn recv(&mut self, buf: &mut [u8], what: &str) -> Result<()> {
        self.sock
            .set_read_timeout(Some(self.timeout))
            .map_err(|e| self.io_error(what, e))?;
        self.sock
            .read_exact(buf)
            .map_err(|e| self.io_error(what, e))
    }

    /// A query: its type, then each argument as a length-prefixed byte string.
    fn query(query: Query, args: &[&[u8]]) -> Vec<u8> {
        let mut q = vec![query as u8];
        for a in args {
            q.extend_from_slice(&(a.len() as u64).to_ne_bytes());
            q.extend_from_slice(a);
        }
        q
    }

    /// The full key: PyTorch's `/`, then this job's prefix.
    fn key(&self, key: &str) -> Vec<u8> {
        format!("{}{key}", self.address.prefix).into_bytes()
    }

    /// Set `key` (under this job's prefix) to `value`.
    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<()> {
        let q = Self::query(Query::Set, &[&self.key(key), value]);
        self.send(&q, &format!("set {key}"))
    }

    /// Every key's value, in order, waiting (up to the timeout) until every key is set.
    pub fn get_all(&mut self, keys: &[String]) -> Result<Vec<Vec<u8>>> {
        let what = match keys {
            [one] => format!("wait for {one}"),
            _ => format!("wait for {} keys", keys.len()),
        };
        let full: Vec<Vec<u8>> = keys.iter().map(|k| self.key(k)).collect();
        let args: Vec<&[u8]> = full.iter().map(Vec::as_slice).collect();
        let counted = |q: Query| {
            let mut b = vec![q as u8];
            b.extend_from_slice(&(keys.len() as u64).to_ne_bytes());
            b.extend_from_slice(&Self::query(q, &args)[1..]);
            b
        };
        self.send(&counted(Query::Wait), &what)?;
        let mut answer = [0u8; 1];
        self.recv(&mut answer, &what)?;
        if answer[0] != STOP_WAITING {
            return Err(Error::system(
                "launcher store",
                what,
                format!(
                    "the store answered {} to a wait: not the protocol this megatrain speaks",
                    answer[0]
                ),
            ));
        }
        let what = what.replacen("wait for", "get", 1);
        self.send(&counted(Query::MultiGet), &what)?;
        let mut values = Vec::with_capacity(keys.len());
        for _ in keys {
            let mut len = [0u8; 8];
            self.recv(&mut len, &what)?;
            let n = u64::from_ne_bytes(len);
            if n > MAX_VALUE {
                return Err(Error::system(
                    "launcher store",
                    what,
                    format!("the store announced a value of {n} bytes, over megatrain's {MAX_VALUE}: not the protocol this megatrain speaks"),
                ));
            }
            let mut value = vec![0u8; n as usize];
            self.recv(&mut value, &what)?;
            values.push(value);
        }
        Ok(values)
    }

    /// `key`'s value, waiting (up to the timeout) until some rank sets it.
    pub fn get(&mut self, key: &str) -> Result<Vec<u8>> {
        let mut v = self.get_all(&[key.to_owned()])?;
        v.pop()
            .ok_or_else(|| Error::internal("launcher store", "one key, no value"))
    }
}

impl std::fmt::Display for StoreAddress {
    /// `host:port`, an IPv6 address in brackets.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.host.contains(':') {
            true => write!(f, "[{}]:{}", self.host, self.port),
            false => write!(f, "{}:{}", self.host, self.port),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn the_address_is_torchruns_variables() {
        let a = StoreAddress::from_vars(vars(&[
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29500"),
            ("TORCHELASTIC_RUN_ID", "abc"),
            ("TORCHELASTIC_RESTART_COUNT", "2"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ]))
        .unwrap();
        assert_eq!(
            a,
            StoreAddress {
                host: "node0".into(),
                port: 29500,
                prefix: "/megatrain/abc/2/".into()
            }
        );
        let e = StoreAddress::from_vars(vars(&[("MASTER_PORT", "1")])).unwrap_err();
        assert!(e.to_string().contains("MASTER_ADDR"), "{e}");
        let e = StoreAddress::from_vars(vars(&[("MASTER_ADDR", "h"), ("MASTER_PORT", "70000")]))
            .unwrap_err();
        assert!(e.to_string().contains("MASTER_PORT=70000"), "{e}");
        // A torchrun that serves no store (rank 0 would be expected to).
        let e = StoreAddress::from_vars(vars(&[
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1"),
            ("TORCHELASTIC_USE_AGENT_STORE", "False"),
        ]))
        .unwrap_err();
        assert!(
            e.to_string().contains("TORCHELASTIC_USE_AGENT_STORE=False"),
            "{e}"
        );
        let v6 = StoreAddress {
            host: "::1".into(),
            port: 29500,
            prefix: String::new(),
        };
        assert_eq!(v6.to_string(), "[::1]:29500");
    }

    #[test]
    fn queries_are_length_prefixed() {
        let q = Store::query(Query::Set, &[b"/k", b"vv"]);
        let mut want = vec![1u8];
        want.extend_from_slice(&2u64.to_ne_bytes());
        want.extend_from_slice(b"/k");
        want.extend_from_slice(&2u64.to_ne_bytes());
        want.extend_from_slice(b"vv");
        assert_eq!(q, want);
    }

    /// A server that answers a wait, then announces a value longer than any megatrain reads:
    /// refused before anything is allocated, naming the length. The queries it received are
    /// the protocol's: VALIDATE with the magic, then WAIT and MULTI_GET of the prefixed key.
    #[test]
    fn an_oversized_value_is_refused() {
        let server = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = server.local_addr().unwrap().port();
        let peer = std::thread::spawn(move || {
            let (mut c, _) = server.accept().unwrap();
            let key = b"/megatrain/t/0/k";
            let mut want = vec![0u8];
            want.extend_from_slice(&MAGIC.to_ne_bytes());
            for q in [Query::Wait, Query::MultiGet] {
                want.push(q as u8);
                want.extend_from_slice(&1u64.to_ne_bytes());
                want.extend_from_slice(&(key.len() as u64).to_ne_bytes());
                want.extend_from_slice(key);
            }
            let mut got = vec![0u8; want.len() - (1 + 8 + 8 + key.len())];
            c.read_exact(&mut got).unwrap();
            c.write_all(&[STOP_WAITING]).unwrap();
            let mut rest = vec![0u8; 1 + 8 + 8 + key.len()];
            c.read_exact(&mut rest).unwrap();
            got.extend_from_slice(&rest);
            c.write_all(&u64::MAX.to_ne_bytes()).unwrap();
            assert_eq!(got, want);
        });
        let a = StoreAddress {
            host: "127.0.0.1".into(),
            port,
            prefix: "/megatrain/t/0/".into(),
        };
        let mut s = Store::connect(&a, Duration::from_secs(10)).unwrap();
        let e = s.get("k").unwrap_err();
        assert!(e.to_string().contains(&u64::MAX.to_string()), "{e}");
        peer.join().unwrap();
    }

    /// Nothing listens: the connection is refused, named with the address, within the timeout.
    #[test]
    fn a_store_that_is_not_there_is_named() {
        let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = free.local_addr().unwrap().port();
        drop(free);
        let a = StoreAddress {
            host: "127.0.0.1".into(),
            port,
            prefix: "/megatrain/t/0/".into(),
        };
        let t0 = Instant::now();
        let e = Store::connect(&a, Duration::from_millis(500)).unwrap_err();
        assert!(t0.elapsed() < Duration::from_secs(10));
        assert!(e.to_string().contains(&format!("127.0.0.1:{port}")), "{e}");
    }
}
