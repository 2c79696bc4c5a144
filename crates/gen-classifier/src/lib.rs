//! Online lifetime classifier: predicts short / mid / long lifetimes and learns from observed frees.
