//! Blocks at chosen addresses: [`Pool::alloc_at`], for restoring a PyTorch private pool to a checkpoint
//! (CUDA graph trees re-create, at the addresses a graph baked in, the blocks that were live when the
//! checkpoint was taken). A child of `pool` so that it books the block exactly as `Pool::alloc` does.

use gen_device::StreamId;

use super::{Block, Pool, ALIGN};
use crate::config::Routing;
use crate::error::{GenpoolError, Result};

impl Pool {
    /// Allocate `size` bytes (rounded up to 512) at exactly `ptr`, for use on `stream`. Only a pool that
    /// routes every block to the extent tier (`experimental.routing:extent`, PyTorch's private pools)
    /// places blocks: `ptr` must lie in one of its extent arenas with the whole range free there.
    /// Otherwise [`GenpoolError::Unplaceable`] (or the sizes and states [`Pool::alloc`] refuses), with
    /// no effect. Pages are created as needed (a capture underway permitting: then never moved).
    pub fn alloc_at(&self, ptr: u64, size: u64, stream: StreamId) -> Result<Block> {
        let unplaceable = |reason| GenpoolError::Unplaceable { ptr, size, reason };
        self.check_size(size)?;
        if self.hot.routing != Routing::Extent {
            return Err(unplaceable(
                "only a pool routing every block to the extent tier places blocks at chosen addresses",
            ));
        }
        if self.pages.is_asleep() {
            return Err(GenpoolError::Asleep);
        }
        if self.recorded(ptr).is_some() {
            return Err(unplaceable("a live block starts there"));
        }
        let requested = size;
        let size = size.div_ceil(ALIGN) * ALIGN;
        self.note_stream(stream);
        // Only pools routing every block to the extent tier place blocks: they make no prediction (as
        // `alloc` with that routing), so there is no stamp to learn from at the free either.
        self.extents.alloc_at(ptr, size)?;
        Ok(self.hand_out(ptr, size, requested, stream))
    }
}
