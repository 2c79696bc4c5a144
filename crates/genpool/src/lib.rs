//! genpool engine: lifetime-classified routing to slab, stream-ordered pool and buddy tiers.
