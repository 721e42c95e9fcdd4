//! Content-addressed block keys.
//!
//! Key of block i = SHA-256(spec fingerprint ‖ key of block i−1 ‖ token ids of
//! block i as little-endian u32). Block 0 chains from 32 zero bytes. A key thus
//! names one exact token prefix under one exact decoder spec.

use sha2::{Digest, Sha256};

/// A block key: 32 bytes of SHA-256.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockKey(pub [u8; 32]);

impl BlockKey {
    pub const ROOT: BlockKey = BlockKey([0; 32]);

    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    pub fn from_hex(s: &str) -> Option<Self> {
        if s.len() != 64 {
            return None;
        }
        let mut out = [0u8; 32];
        for (i, byte) in out.iter_mut().enumerate() {
            *byte = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
        }
        Some(BlockKey(out))
    }

    pub fn from_slice(bytes: &[u8]) -> Option<Self> {
        bytes.try_into().ok().map(BlockKey)
    }
}

impl std::fmt::Debug for BlockKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BlockKey({})", &self.to_hex()[..16])
    }
}

impl std::fmt::Display for BlockKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// Key of the block holding `tokens`, given the previous block's key.
pub fn chain(spec_fingerprint: &str, parent: &BlockKey, tokens: &[u32]) -> BlockKey {
    let mut h = Sha256::new();
    h.update(spec_fingerprint.as_bytes());
    h.update(parent.0);
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    BlockKey(h.finalize().into())
}

/// Key of a prompt's tail after its whole blocks (`keys`, the prompt's block
/// keys): chained like one more block, from the last of them. Sender and
/// receiver of a tail both name it this way.
pub fn tail_key(spec_fingerprint: &str, keys: &[BlockKey], tail_tokens: &[u32]) -> BlockKey {
    chain(spec_fingerprint, keys.last().unwrap_or(&BlockKey::ROOT), tail_tokens)
}

/// Keys of every whole block of `tokens` (a trailing partial block has none).
pub fn keys(spec_fingerprint: &str, tokens: &[u32], block_tokens: usize) -> Vec<BlockKey> {
    let mut parent = BlockKey::ROOT;
    tokens
        .chunks_exact(block_tokens)
        .map(|block| {
            parent = chain(spec_fingerprint, &parent, block);
            parent
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_depends_on_every_earlier_token_and_the_spec() {
        let tokens: Vec<u32> = (0..10).collect();
        let base = keys("spec-a", &tokens, 4);
        assert_eq!(base.len(), 2, "the trailing partial block has no key");

        let mut changed = tokens.clone();
        changed[0] = 99;
        let other = keys("spec-a", &changed, 4);
        assert_ne!(base[0], other[0]);
        assert_ne!(base[1], other[1], "block 1 chains from block 0");

        assert_ne!(base, keys("spec-b", &tokens, 4));
        assert_eq!(base, keys("spec-a", &tokens, 4));
    }

    #[test]
    fn hex_round_trips() {
        let k = keys("s", &[1, 2, 3, 4], 4)[0];
        assert_eq!(BlockKey::from_hex(&k.to_hex()), Some(k));
        assert_eq!(BlockKey::from_hex("zz"), None);
    }
}
