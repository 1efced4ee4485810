//! What a RESP listener keeps about its connections (`CLIENT LIST`, `CLIENT KILL`)
//! and about `SCAN`'s cursors.
//!
//! Every connection registers a [`ClientRecord`] for its life (a [`ClientGuard`] in
//! its session drops it); `CLIENT KILL` marks records and wakes their connections,
//! which close before their next read.
//!
//! `SCAN`'s cursor is a number, as clients parse it (redis-py's `scan_iter` reads it
//! as an integer), while where a listing stands is the last name it answered. The
//! listener keeps that name under a number it hands out ([`ScanCursors`]), shared by
//! every connection of the node, so a client whose pool sends the next page on
//! another connection goes on where it stood. A cursor is known to the node that
//! answered it, for as long as [`SCAN_CURSORS_MAX`] newer cursors have not pushed
//! it out; an unknown one is refused (`ERR invalid cursor`), never taken as 0.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;

/// Most `SCAN` cursors a listener remembers: each is one counter name (at most
/// `tally_core::name::NAME_LEN_MAX`, 1,536 bytes, escaped), so they take about
/// 6 MiB at most and far less for realistic names; the oldest go first.
pub const SCAN_CURSORS_MAX: usize = 4_096;

/// A connection's `CLIENT SETNAME` name, and `CLIENT SETINFO`'s library name and
/// version.
pub type ClientNames = (Option<Vec<u8>>, Option<Vec<u8>>, Option<Vec<u8>>);

/// One connection, as `CLIENT LIST` shows it.
#[derive(Debug)]
pub struct ClientRecord {
    /// Its id.
    pub id: u64,
    /// The client's address.
    pub addr: SocketAddr,
    /// The listener's address.
    pub laddr: SocketAddr,
    /// When it connected.
    pub since: Instant,
    /// Milliseconds after `since` of its last command.
    pub last_ms: AtomicU64,
    /// `CLIENT SETNAME`'s name, `CLIENT SETINFO`'s library name and version.
    pub names: parking_lot::Mutex<ClientNames>,
    /// The last command's name, lowercase.
    pub last_cmd: parking_lot::Mutex<&'static str>,
    /// The protocol in use (2 or 3).
    pub resp: AtomicU8,
    /// Set by `CLIENT KILL`.
    pub killed: AtomicBool,
    /// Wakes the connection when it is killed.
    pub kill: tokio::sync::Notify,
}

impl ClientRecord {
    /// Notes a command named `op` (uppercase) now.
    pub fn seen(&self, op: &'static str) {
        self.last_ms.store(self.since.elapsed().as_millis() as u64, Relaxed);
        *self.last_cmd.lock() = op;
    }

    /// Resolves once the connection has been killed.
    pub async fn killed(&self) {
        loop {
            let notified = self.kill.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.killed.load(Relaxed) {
                return;
            }
            notified.await;
        }
    }

    /// `CLIENT LIST`'s line for this connection (Redis's fields that have a
    /// meaning here; `db=0` always).
    pub fn line(&self) -> String {
        let (name, lib, ver) = self.names.lock().clone();
        let text =
            |v: Option<Vec<u8>>| v.map(|v| String::from_utf8_lossy(&v).into_owned()).unwrap_or_default();
        let age = self.since.elapsed().as_secs();
        let idle =
            (self.since.elapsed().as_millis() as u64).saturating_sub(self.last_ms.load(Relaxed)) / 1000;
        format!(
            "id={} addr={} laddr={} fd=-1 name={} age={age} idle={idle} flags=N db=0 sub=0 psub=0 ssub=0 \
             multi=-1 watch=0 cmd={} user=default resp={} lib-name={} lib-ver={}",
            self.id,
            self.addr,
            self.laddr,
            text(name),
            self.last_cmd.lock().to_ascii_lowercase(),
            self.resp.load(Relaxed),
            text(lib),
            text(ver),
        )
    }
}

/// The listener's registry of open connections, by id.
pub type Clients = parking_lot::Mutex<BTreeMap<u64, Arc<ClientRecord>>>;

/// A connection's place in the registry, removed when its session ends.
#[derive(Debug)]
pub struct ClientGuard {
    /// The record.
    pub record: Arc<ClientRecord>,
    registry: Arc<Clients>,
}

impl ClientGuard {
    /// Registers connection `id` from `addr` on the listener at `laddr`.
    pub fn register(registry: &Arc<Clients>, id: u64, addr: SocketAddr, laddr: SocketAddr) -> Self {
        let record = Arc::new(ClientRecord {
            id,
            addr,
            laddr,
            since: Instant::now(),
            last_ms: AtomicU64::new(0),
            names: Default::default(),
            last_cmd: parking_lot::Mutex::new("NULL"),
            resp: AtomicU8::new(2),
            killed: AtomicBool::new(false),
            kill: tokio::sync::Notify::new(),
        });
        registry.lock().insert(id, record.clone());
        Self { record, registry: registry.clone() }
    }
}

impl Drop for ClientGuard {
    fn drop(&mut self) {
        self.registry.lock().remove(&self.record.id);
    }
}

/// Marks every connection `matches` chooses as killed and wakes it; answers how many.
pub fn kill(registry: &Clients, matches: impl Fn(&ClientRecord) -> bool) -> usize {
    let chosen: Vec<Arc<ClientRecord>> = registry.lock().values().filter(|r| matches(r)).cloned().collect();
    for r in &chosen {
        r.killed.store(true, Relaxed);
        r.kill.notify_waiters();
    }
    chosen.len()
}

/// `SCAN`'s cursors: the last name a page answered, under the number the client
/// sends back.
#[derive(Debug, Default)]
pub struct ScanCursors {
    last: u64,
    names: HashMap<u64, String>,
    order: VecDeque<u64>,
}

impl ScanCursors {
    /// A new cursor standing after `name`.
    pub fn open(&mut self, name: String) -> u64 {
        self.last = self.last.wrapping_add(1).max(1);
        let id = self.last;
        if self.order.len() >= SCAN_CURSORS_MAX {
            if let Some(old) = self.order.pop_front() {
                self.names.remove(&old);
            }
        }
        self.names.insert(id, name);
        self.order.push_back(id);
        id
    }

    /// Where cursor `id` stands, if this listener still knows it.
    pub fn get(&self, id: u64) -> Option<&str> {
        self.names.get(&id).map(String::as_str)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_are_numbers_the_oldest_of_which_are_forgotten() {
        let mut c = ScanCursors::default();
        let first = c.open("a".into());
        assert_eq!(c.get(first), Some("a"));
        assert_eq!(c.get(0), None, "0 is never a cursor: it starts a scan");
        for i in 0..SCAN_CURSORS_MAX {
            c.open(format!("n{i}"));
        }
        assert_eq!(c.get(first), None);
        assert_eq!(c.names.len(), SCAN_CURSORS_MAX);
    }

    #[test]
    fn a_killed_client_leaves_the_registry_with_its_session() {
        let registry: Arc<Clients> = Default::default();
        let addr: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let a = ClientGuard::register(&registry, 1, addr, addr);
        let _b = ClientGuard::register(&registry, 2, addr, addr);
        assert_eq!(kill(&registry, |r| r.id == 1), 1);
        assert!(a.record.killed.load(Relaxed));
        assert!(a.record.line().starts_with("id=1 addr=127.0.0.1:1 "));
        drop(a);
        assert_eq!(registry.lock().keys().copied().collect::<Vec<_>>(), [2]);
    }
}
