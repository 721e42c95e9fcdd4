//! Which blocks of a prompt a transfer computes and pushes.

use pdbridge_common::{
    proto::{CacheSpec, Outcome, outcome::Status as OutcomeStatus},
    reason::Reason,
    spec,
};

use super::{Failure, fail};

/// Which blocks of a prompt a transfer computes and pushes, decided before
/// anything runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Plan {
    pub(super) block_tokens: u32,
    /// Whole blocks of the prompt the decoder can store.
    pub(super) whole_blocks: u32,
    /// The first block to push; the decoder holds those before it.
    pub(super) first_block: u32,
    /// Rows after the last whole block, all but the prompt's last token
    /// (shorter than a block by construction); 0 for none.
    pub(super) tail_tokens: u32,
}

impl Plan {
    pub(super) fn new(spec: &CacheSpec, token_ids: &[u32], first_block: u32, tail: bool) -> Plan {
        let block_tokens = spec.block_tokens;
        let whole_blocks = spec::storable(spec, token_ids).len() as u32 / block_tokens;
        // A pooled layer stores no tail; the decoder computes those tokens itself.
        let tail = tail && spec::tail_unsupported(spec).is_none();
        let tail_tokens =
            if tail { (token_ids.len() as u32 - 1).saturating_sub(whole_blocks * block_tokens) } else { 0 };
        Plan { block_tokens, whole_blocks, first_block, tail_tokens }
    }

    pub(super) fn num_blocks(&self) -> u32 {
        self.whole_blocks.saturating_sub(self.first_block)
    }

    /// The tokens vLLM prefills: the whole blocks, then the tail.
    pub(super) fn prompt_tokens(&self) -> usize {
        (self.whole_blocks * self.block_tokens + self.tail_tokens) as usize
    }

    /// The outcome when the decoder holds every whole block already.
    pub(super) fn already_cached(&self) -> Option<Outcome> {
        (self.num_blocks() == 0).then(|| Outcome {
            status: OutcomeStatus::Bridged as i32,
            tokens_covered: self.whole_blocks * self.block_tokens,
            detail: "already cached".into(),
            ..Default::default()
        })
    }

    /// Whether block `index` from the plugin is the tail (block
    /// `whole_blocks`, when one was asked for); a failure outside the plan.
    pub(super) fn is_tail(&self, index: u32) -> Result<bool, Failure> {
        let tail = index == self.whole_blocks && self.tail_tokens > 0;
        if index < self.first_block || (index >= self.whole_blocks && !tail) {
            let range = format!("{}..{}", self.first_block, self.whole_blocks);
            return Err(fail(Reason::PrefillFailed, format!("plugin sent block {index} outside {range}")));
        }
        Ok(tail)
    }
}
