//! Shard framing: how one block tensor travels as CRC-checked slices, and how
//! the receiver proves it got every byte exactly once.
//!
//! The sender cuts a tensor's little-endian bytes into payloads of at most
//! `max_payload` bytes ([`split`]); the receiver checks each shard against the
//! tensor it expects ([`Expected::check`]) and fills a [`TensorAssembly`], which
//! refuses overlaps and knows when the tensor is complete.

use std::collections::BTreeMap;

use bytes::Bytes;

use crate::proto::{Dtype, Shard};

/// Why a shard was refused. Each variant maps to one gRPC status in the
/// service layer; nothing here knows about tonic.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ShardError {
    #[error("shard checksum mismatch (crc32c {got:#010x}, expected {want:#010x})")]
    Checksum { got: u32, want: u32 },
    #[error("dtype {got:?} does not match the spec's {want:?}")]
    Dtype { got: Dtype, want: Dtype },
    #[error("shape {got:?} does not match the spec's {want:?}")]
    Shape { got: Vec<u64>, want: Vec<u64> },
    #[error("bytes {offset}..{end} fall outside the tensor's {len} bytes")]
    OutOfRange { offset: u64, end: u64, len: u64 },
    #[error("bytes {offset}..{end} overlap bytes already received")]
    Duplicate { offset: u64, end: u64 },
    #[error("empty payload")]
    Empty,
}

/// The checksum every shard carries: CRC32C (Castagnoli), hardware-accelerated
/// on x86_64 and aarch64.
pub fn checksum(payload: &[u8]) -> u32 {
    crc32c::crc32c(payload)
}

/// What the receiver expects one block tensor to be.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Expected {
    pub dtype: Dtype,
    pub shape: Vec<u64>,
}

impl Expected {
    /// Byte length of the whole tensor.
    pub fn byte_len(&self) -> u64 {
        let elems: u64 = self.shape.iter().product();
        elems * self.dtype.size_bytes().unwrap_or(0) as u64
    }

    /// Checks everything about `shard` that does not depend on other shards.
    pub fn check(&self, shard: &Shard) -> Result<(), ShardError> {
        let dtype = shard.dtype();
        if dtype != self.dtype {
            return Err(ShardError::Dtype { got: dtype, want: self.dtype });
        }
        if shard.shape != self.shape {
            return Err(ShardError::Shape { got: shard.shape.clone(), want: self.shape.clone() });
        }
        if shard.payload.is_empty() {
            return Err(ShardError::Empty);
        }
        let len = self.byte_len();
        let end = shard.byte_offset.saturating_add(shard.payload.len() as u64);
        if end > len {
            return Err(ShardError::OutOfRange { offset: shard.byte_offset, end, len });
        }
        let got = checksum(&shard.payload);
        if got != shard.crc32c {
            return Err(ShardError::Checksum { got, want: shard.crc32c });
        }
        Ok(())
    }
}

/// The received byte ranges of one tensor, and its bytes once complete.
#[derive(Debug)]
pub struct TensorAssembly {
    len: u64,
    received: u64,
    /// Start offset → payload; non-overlapping by construction.
    parts: BTreeMap<u64, Bytes>,
}

impl TensorAssembly {
    pub fn new(byte_len: u64) -> Self {
        Self { len: byte_len, received: 0, parts: BTreeMap::new() }
    }

    /// Adds a payload already checked by [`Expected::check`].
    pub fn insert(&mut self, offset: u64, payload: Bytes) -> Result<(), ShardError> {
        let end = offset + payload.len() as u64;
        let overlaps_prev =
            self.parts.range(..=offset).next_back().is_some_and(|(start, p)| start + p.len() as u64 > offset);
        let overlaps_next = self.parts.range(offset..).next().is_some_and(|(start, _)| *start < end);
        if overlaps_prev || overlaps_next {
            return Err(ShardError::Duplicate { offset, end });
        }
        self.received += payload.len() as u64;
        self.parts.insert(offset, payload);
        Ok(())
    }

    pub fn is_complete(&self) -> bool {
        self.received == self.len
    }

    /// The tensor's parts in byte order; only meaningful once complete.
    pub fn into_parts(self) -> Vec<Bytes> {
        self.parts.into_values().collect()
    }
}

/// Which tensor a run of shards belongs to.
#[derive(Clone, Debug)]
pub struct TensorId {
    pub block_index: u32,
    pub layer: u32,
    pub tensor: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
}

/// Cuts one tensor's bytes into shards of at most `max_payload` bytes each.
/// `data` is shared, not copied: every payload is a slice of it.
pub fn split(id: &TensorId, data: Bytes, max_payload: usize) -> impl Iterator<Item = Shard> + '_ {
    assert!(max_payload > 0, "max_payload must be positive");
    let len = data.len();
    (0..len).step_by(max_payload).map(move |start| {
        let payload = data.slice(start..len.min(start + max_payload));
        Shard {
            block_index: id.block_index,
            layer: id.layer,
            tensor: id.tensor.clone(),
            dtype: id.dtype as i32,
            shape: id.shape.clone(),
            byte_offset: start as u64,
            crc32c: checksum(&payload),
            payload,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor() -> (TensorId, Expected, Bytes) {
        let shape = vec![1, 3, 4, 8];
        let expected = Expected { dtype: Dtype::F32, shape: shape.clone() };
        let data: Vec<u8> = (0..expected.byte_len()).map(|i| (i * 7 % 251) as u8).collect();
        let id = TensorId { block_index: 2, layer: 5, tensor: "keys".into(), dtype: Dtype::F32, shape };
        (id, expected, Bytes::from(data))
    }

    #[test]
    fn split_shards_reassemble_to_the_same_bytes() {
        let (id, expected, data) = tensor();
        let shards: Vec<_> = split(&id, data.clone(), 100).collect();
        assert_eq!(shards.len(), data.len().div_ceil(100));
        let mut asm = TensorAssembly::new(expected.byte_len());
        for shard in shards.into_iter().rev() {
            expected.check(&shard).unwrap();
            assert!(!asm.is_complete());
            asm.insert(shard.byte_offset, shard.payload).unwrap();
        }
        assert!(asm.is_complete());
        let joined: Vec<u8> = asm.into_parts().concat();
        assert_eq!(joined, data);
    }

    #[test]
    fn corrupt_shard_fails_its_checksum() {
        let (id, expected, data) = tensor();
        let mut shard = split(&id, data, 64).next().unwrap();
        let mut bytes = shard.payload.to_vec();
        bytes[3] ^= 0x40;
        shard.payload = bytes.into();
        assert!(matches!(expected.check(&shard), Err(ShardError::Checksum { .. })));
    }

    #[test]
    fn wrong_dtype_shape_and_range_are_refused() {
        let (id, expected, data) = tensor();
        let good = split(&id, data, 64).nth(1).unwrap();

        let mut s = good.clone();
        s.dtype = Dtype::F16 as i32;
        assert!(matches!(expected.check(&s), Err(ShardError::Dtype { .. })));

        let mut s = good.clone();
        s.shape = vec![1, 3, 5, 8];
        assert!(matches!(expected.check(&s), Err(ShardError::Shape { .. })));

        let mut s = good.clone();
        s.byte_offset = expected.byte_len() - 10;
        assert!(matches!(expected.check(&s), Err(ShardError::OutOfRange { .. })));

        let mut s = good;
        s.byte_offset = u64::MAX - 3;
        assert!(matches!(expected.check(&s), Err(ShardError::OutOfRange { .. })), "no overflow");
    }

    #[test]
    fn overlapping_or_repeated_bytes_are_duplicates() {
        let mut asm = TensorAssembly::new(100);
        asm.insert(10, Bytes::from(vec![0; 20])).unwrap();
        assert!(matches!(asm.insert(10, Bytes::from(vec![0; 20])), Err(ShardError::Duplicate { .. })));
        assert!(matches!(asm.insert(0, Bytes::from(vec![0; 11])), Err(ShardError::Duplicate { .. })));
        assert!(matches!(asm.insert(29, Bytes::from(vec![0; 5])), Err(ShardError::Duplicate { .. })));
        asm.insert(0, Bytes::from(vec![0; 10])).unwrap();
        asm.insert(30, Bytes::from(vec![0; 70])).unwrap();
        assert!(asm.is_complete());
    }

    /// Fuzzing the shard path with hostile shards: whatever a peer sends, `check` and
    /// `insert` never panic, no accepted byte lies outside the tensor or is accepted twice,
    /// and a tensor completes exactly when every byte arrived once, with the sent bytes.
    mod fuzz {
        use proptest::prelude::*;

        use super::*;

        /// A shard of the test tensor with any offset, length, checksum or damage.
        fn hostile_shard(len: u64) -> impl Strategy<Value = Shard> {
            let offset = prop_oneof![0..len + 8, Just(u64::MAX), any::<u64>()];
            (offset, 0usize..200, any::<bool>(), any::<u32>(), any::<bool>()).prop_map(
                move |(byte_offset, n, honest_crc, crc, right_shape)| {
                    let payload = Bytes::from(vec![0xA5; n]);
                    Shard {
                        block_index: 0,
                        layer: 0,
                        tensor: "keys".into(),
                        dtype: Dtype::F32 as i32,
                        shape: if right_shape { vec![1, 3, 4, 8] } else { vec![3, 1, 4, 8] },
                        byte_offset,
                        crc32c: if honest_crc { checksum(&payload) } else { crc },
                        payload,
                    }
                },
            )
        }

        proptest! {
            // At least this many cases; PROPTEST_CASES asks for more.
            #![proptest_config(ProptestConfig { cases: ProptestConfig::default().cases.max(2048), ..ProptestConfig::default() })]

            #[test]
            fn hostile_shards_never_overfill_a_tensor(shards in prop::collection::vec(hostile_shard(384), 0..64)) {
                let (_, expected, _) = tensor();
                let len = expected.byte_len();
                let mut asm = TensorAssembly::new(len);
                let mut covered = vec![false; len as usize];
                for shard in shards {
                    if expected.check(&shard).is_err() {
                        continue;
                    }
                    let (start, end) = (shard.byte_offset as usize, shard.byte_offset as usize + shard.payload.len());
                    let fresh = covered[start..end].iter().all(|c| !c);
                    prop_assert_eq!(asm.insert(shard.byte_offset, shard.payload).is_ok(), fresh);
                    if fresh {
                        covered[start..end].iter_mut().for_each(|c| *c = true);
                    }
                    prop_assert_eq!(asm.is_complete(), covered.iter().all(|c| *c));
                }
            }

            #[test]
            fn any_split_in_any_order_reassembles_the_same_bytes(max_payload in 1usize..400, seed in any::<u64>()) {
                let (id, expected, data) = tensor();
                let mut shards: Vec<Shard> = split(&id, data.clone(), max_payload).collect();
                // A seeded Fisher-Yates shuffle: arrival order is the network's.
                let mut state = seed | 1;
                for i in (1..shards.len()).rev() {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    shards.swap(i, (state % (i as u64 + 1)) as usize);
                }
                let mut asm = TensorAssembly::new(expected.byte_len());
                for shard in shards {
                    expected.check(&shard).unwrap();
                    asm.insert(shard.byte_offset, shard.payload).unwrap();
                }
                prop_assert!(asm.is_complete());
                prop_assert_eq!(asm.into_parts().concat(), data.to_vec());
            }
        }
    }
}
