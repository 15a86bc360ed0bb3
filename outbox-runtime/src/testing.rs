//! Test support. (Being written.)
