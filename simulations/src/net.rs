//! The simulated network: delay (and so reordering), loss, duplication, and
//! partitions, symmetric or one-way, between nodes.
//!
//! Clients reach every node (they stand on the node's side of any partition, like an
//! application server in the same rack); node-to-node links are what partitions cut.
//! Client requests are never duplicated by the network (HTTP over TCP is not), while
//! node-to-node messages may be: the transport may resend after a reconnect.

use crate::config::{NET_DELAY_MS_MAX, NET_DELAY_MS_MIN};
use crate::msg::Addr;
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use std::collections::BTreeMap;

/// What the network does with one message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fate {
    /// Delivered after each listed delay (two delays: duplicated).
    Deliver(Vec<u64>),
    /// Dropped by a partition.
    Cut,
    /// Lost.
    Lost,
}

/// Link state and fault rates.
#[derive(Debug, Clone, Default)]
pub struct Network {
    /// Directed node links that are cut, with how many active partitions cut each
    /// (partitions may overlap).
    blocked: BTreeMap<(u8, u8), u32>,
    /// Probability of losing a message.
    pub loss: f64,
    /// Probability of delivering a node-to-node message twice.
    pub duplicate: f64,
    /// Largest extra delay.
    pub delay_extra_ms_max: u64,
}

impl Network {
    /// A network with these fault rates and no partition.
    pub fn new(loss: f64, duplicate: f64, delay_extra_ms_max: u64) -> Self {
        Self { blocked: BTreeMap::new(), loss, duplicate, delay_extra_ms_max }
    }

    /// Cuts the directed links in `links`.
    pub fn cut(&mut self, links: &[(u8, u8)]) {
        for l in links {
            *self.blocked.entry(*l).or_default() += 1;
        }
    }

    /// Restores links cut by one partition.
    pub fn restore(&mut self, links: &[(u8, u8)]) {
        for l in links {
            if let Some(n) = self.blocked.get_mut(l) {
                *n -= 1;
                if *n == 0 {
                    self.blocked.remove(l);
                }
            }
        }
    }

    /// Heals everything: no partitions, no loss, no duplication, no extra delay.
    pub fn heal(&mut self) {
        self.blocked.clear();
        self.loss = 0.0;
        self.duplicate = 0.0;
        self.delay_extra_ms_max = 0;
    }

    /// Whether the directed link `from → to` between nodes works.
    pub fn link_up(&self, from: u8, to: u8) -> bool {
        from == to || !self.blocked.contains_key(&(from, to))
    }

    /// Whether any partition is active.
    pub fn partitioned(&self) -> bool {
        !self.blocked.is_empty()
    }

    /// Decides the fate of one message from `from` to `to`.
    pub fn fate(&self, from: Addr, to: Addr, rng: &mut ChaCha8Rng) -> Fate {
        if from == to {
            return Fate::Deliver(vec![0]);
        }
        if let (Addr::Node(a), Addr::Node(b)) = (from, to) {
            if !self.link_up(a, b) {
                return Fate::Cut;
            }
        }
        if self.loss > 0.0 && rng.random::<f64>() < self.loss {
            return Fate::Lost;
        }
        let delay = |rng: &mut ChaCha8Rng| {
            rng.random_range(NET_DELAY_MS_MIN..=NET_DELAY_MS_MAX + self.delay_extra_ms_max)
        };
        let first = delay(rng);
        let node_to_node = matches!((from, to), (Addr::Node(_), Addr::Node(_)));
        if node_to_node && self.duplicate > 0.0 && rng.random::<f64>() < self.duplicate {
            let second = delay(rng);
            return Fate::Deliver(vec![first, second]);
        }
        Fate::Deliver(vec![first])
    }
}
