//! Partition drills: the shipped allocator and agent logic under virtual time and injected faults,
//! measuring overshoot and stranded tokens against the stated bound.
//!
//! Architecture invariant: drills run the real crates through their store, clock and transport seams;
//! they never re-implement the algorithms.
