//! A global allocator that starts every block of a kilobyte or more on a cache line.
//!
//! The kernels load rows of their operands a vector at a time, at offsets that are multiples of
//! the vector's width from each row's start. The system allocator returns 16-byte aligned blocks,
//! so with the flat parameter buffer, the activations and the gathered batch all at 16 bytes past a
//! cache line, every other 32-byte load (and every 64-byte one) straddles two lines and costs two.
//! Starting large blocks on a line (as PyTorch's CPU allocator does, at 64 bytes) makes the loads
//! of every row whose length is a multiple of 16 floats whole-line ones. Small blocks keep the
//! system's alignment: padding them would cost memory for no load that matters.
//!
//! The binary installs it; a program of its own that calls the kernels does the same with
//! `#[global_allocator] static ALLOC: lbbsp::CacheAligned = lbbsp::CacheAligned;`.

use std::alloc::{GlobalAlloc, Layout, System};

/// See the module's doc.
pub struct CacheAligned;

/// A cache line.
const LINE: usize = 64;
/// Blocks from this size on start on a line.
const LARGE: usize = 1024;

/// The layout a block is really allocated with: a function of the requested layout alone, so that
/// allocation, reallocation and deallocation agree.
fn widened(layout: Layout) -> Layout {
    if layout.size() >= LARGE && layout.align() < LINE {
        // A size ≥ 1 KiB rounded up to 64 cannot overflow isize where the request did not.
        Layout::from_size_align(layout.size(), LINE).unwrap_or(layout)
    } else {
        layout
    }
}

// SAFETY: every block is allocated and freed by the system allocator with the same widened
// layout, which is the requested one or the same size with a stricter alignment, so each block
// satisfies the layout asked for; a reallocation that changes the widened alignment moves the
// block by hand (allocate, copy the smaller size, free) as the system's own fallback does.
unsafe impl GlobalAlloc for CacheAligned {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        System.alloc(widened(layout))
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        System.alloc_zeroed(widened(layout))
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, widened(layout))
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let old = widened(layout);
        let Ok(asked) = Layout::from_size_align(new_size, layout.align()) else {
            return std::ptr::null_mut();
        };
        let new = widened(asked);
        if new.align() == old.align() {
            return System.realloc(ptr, old, new_size);
        }
        let moved = System.alloc(new);
        if !moved.is_null() {
            std::ptr::copy_nonoverlapping(ptr, moved, layout.size().min(new_size));
            System.dealloc(ptr, old);
        }
        moved
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_blocks_start_on_a_line_and_keep_their_contents_when_they_grow() {
        let a = CacheAligned;
        // SAFETY: each block is used within its layout and freed with it.
        unsafe {
            let small = Layout::from_size_align(100, 4).unwrap();
            let p = a.alloc(small);
            assert!(!p.is_null());
            for i in 0..100 {
                *p.add(i) = i as u8;
            }
            // Small to large (the alignment widens), large to larger, back to small.
            let mut q = a.realloc(p, small, 5000);
            assert_eq!(q as usize % LINE, 0);
            assert!((0..100).all(|i| *q.add(i) == i as u8));
            q = a.realloc(q, Layout::from_size_align(5000, 4).unwrap(), 1 << 20);
            assert_eq!(q as usize % LINE, 0);
            assert!((0..100).all(|i| *q.add(i) == i as u8));
            q = a.realloc(q, Layout::from_size_align(1 << 20, 4).unwrap(), 50);
            assert!((0..50).all(|i| *q.add(i) == i as u8));
            a.dealloc(q, Layout::from_size_align(50, 4).unwrap());
            let z = a.alloc_zeroed(Layout::from_size_align(4096, 4).unwrap());
            assert_eq!(z as usize % LINE, 0);
            assert!((0..4096).all(|i| *z.add(i) == 0));
            a.dealloc(z, Layout::from_size_align(4096, 4).unwrap());
        }
    }
}
