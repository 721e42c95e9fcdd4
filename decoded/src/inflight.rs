//! Bridges in progress, by the block keys they are producing, so concurrent
//! requests that need the same blocks share one prefill: the first claims the
//! blocks it will bridge, a second whose first missing block is among them
//! waits for that bridge to end, then reads the blocks from the store and
//! bridges only what is still missing.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use pdbridge_common::block::BlockKey;
use tokio::sync::watch;

#[derive(Clone, Default)]
pub struct Bridges(Arc<Mutex<State>>);

#[derive(Default)]
struct State {
    /// Block key → the claim producing it.
    producing: HashMap<BlockKey, Claimed>,
    next_id: u64,
}

struct Claimed {
    id: u64,
    ended: watch::Receiver<()>,
}

/// What a request should do about the blocks it is missing.
pub enum Claim {
    /// Bridge them; the blocks are claimed until this is dropped.
    Produce(Producing),
    /// Another request is bridging the first of them: wait for it, then look
    /// at the store again.
    Wait(Ended),
}

/// Held by the request bridging some blocks. Dropping it — the bridge done,
/// failed or cancelled — releases the requests waiting on those blocks.
pub struct Producing {
    bridges: Bridges,
    id: u64,
    keys: Vec<BlockKey>,
    _ended: watch::Sender<()>,
}

/// The end of another request's bridge.
pub struct Ended(watch::Receiver<()>);

impl Ended {
    pub async fn wait(mut self) {
        // Nothing is ever sent: the sender's drop is the signal.
        while self.0.changed().await.is_ok() {}
    }
}

impl Bridges {
    /// `missing`: the keys a request lacks, in prompt order (the first is its
    /// first missing block).
    pub fn claim(&self, missing: &[BlockKey]) -> Claim {
        let mut state = self.0.lock().unwrap();
        if let Some(claimed) = missing.first().and_then(|key| state.producing.get(key)) {
            return Claim::Wait(Ended(claimed.ended.clone()));
        }
        let id = state.next_id;
        state.next_id += 1;
        let (tx, rx) = watch::channel(());
        for key in missing {
            state.producing.entry(*key).or_insert_with(|| Claimed { id, ended: rx.clone() });
        }
        Claim::Produce(Producing { bridges: self.clone(), id, keys: missing.to_vec(), _ended: tx })
    }
}

impl Drop for Producing {
    fn drop(&mut self) {
        let mut state = self.bridges.0.lock().unwrap();
        for key in &self.keys {
            if state.producing.get(key).is_some_and(|claimed| claimed.id == self.id) {
                state.producing.remove(key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn keys(n: u8) -> Vec<BlockKey> {
        (0..n).map(|i| BlockKey([i; 32])).collect()
    }

    #[tokio::test]
    async fn a_second_claim_on_the_same_first_block_waits_until_the_first_ends() {
        let bridges = Bridges::default();
        let k = keys(4);
        let Claim::Produce(first) = bridges.claim(&k[1..]) else { panic!("nothing in flight yet") };
        // A prompt that shares the first missing block waits; one that starts elsewhere does not.
        let Claim::Wait(ended) = bridges.claim(&k[1..3]) else { panic!("block 1 is in flight") };
        assert!(matches!(bridges.claim(&k[..1]), Claim::Produce(_)));
        let waiter = tokio::spawn(ended.wait());
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished(), "released before the bridge ended");
        drop(first);
        tokio::time::timeout(Duration::from_secs(1), waiter).await.expect("released").unwrap();
        assert!(matches!(bridges.claim(&k[1..]), Claim::Produce(_)), "the keys are free again");
    }
}
