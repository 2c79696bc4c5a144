//! Call-site hashing: the 48-bit site id of an allocation from its top Python frames.
//!
//! The hash is BLAKE2b with a 6-byte digest over `"file:line:name|file:line:name|..."` (top
//! [`SITE_FRAMES`] frames), read as a little-endian integer. This is exactly what
//! `tools/capture.py` (`site_hash`) writes into the CSV traces, so a program captured either way gets the
//! same site ids. One difference: an allocation with no frames gets site 0 ("unknown"), as the trace
//! format specifies.

/// How many of the innermost frames make up a site.
pub const SITE_FRAMES: usize = 8;

/// One Python stack frame of an allocation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    /// Source file.
    pub filename: String,
    /// Line number.
    pub line: i64,
    /// Function name.
    pub name: String,
}

/// The 48-bit site id of an allocation made under `frames` (innermost first); 0 when `frames` is empty.
pub fn site_hash(frames: &[Frame]) -> u64 {
    if frames.is_empty() {
        return 0;
    }
    let mut key = String::new();
    for (i, f) in frames.iter().take(SITE_FRAMES).enumerate() {
        if i > 0 {
            key.push('|');
        }
        key.push_str(&f.filename);
        key.push(':');
        key.push_str(&f.line.to_string());
        key.push(':');
        key.push_str(&f.name);
    }
    let d = blake2b::<6>(key.as_bytes());
    let mut b = [0u8; 8];
    b[..6].copy_from_slice(&d);
    u64::from_le_bytes(b)
}

const IV: [u64; 8] = [
    0x6a09e667f3bcc908,
    0xbb67ae8584caa73b,
    0x3c6ef372fe94f82b,
    0xa54ff53a5f1d36f1,
    0x510e527fade682d1,
    0x9b05688c2b3e6c1f,
    0x1f83d9abfb41bd6b,
    0x5be0cd19137e2179,
];

const SIGMA: [[usize; 16]; 10] = [
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
    [14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3],
    [11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4],
    [7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8],
    [9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13],
    [2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9],
    [12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11],
    [13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10],
    [6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5],
    [10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0],
];

#[inline]
fn g(v: &mut [u64; 16], a: usize, b: usize, c: usize, d: usize, x: u64, y: u64) {
    v[a] = v[a].wrapping_add(v[b]).wrapping_add(x);
    v[d] = (v[d] ^ v[a]).rotate_right(32);
    v[c] = v[c].wrapping_add(v[d]);
    v[b] = (v[b] ^ v[c]).rotate_right(24);
    v[a] = v[a].wrapping_add(v[b]).wrapping_add(y);
    v[d] = (v[d] ^ v[a]).rotate_right(16);
    v[c] = v[c].wrapping_add(v[d]);
    v[b] = (v[b] ^ v[c]).rotate_right(63);
}

fn compress(h: &mut [u64; 8], block: &[u8; 128], t: u128, last: bool) {
    let mut m = [0u64; 16];
    for (i, w) in m.iter_mut().enumerate() {
        let mut b = [0u8; 8];
        b.copy_from_slice(&block[i * 8..i * 8 + 8]);
        *w = u64::from_le_bytes(b);
    }
    let mut v = [0u64; 16];
    v[..8].copy_from_slice(h);
    v[8..].copy_from_slice(&IV);
    v[12] ^= t as u64;
    v[13] ^= (t >> 64) as u64;
    if last {
        v[14] = !v[14];
    }
    for r in 0..12 {
        let s = &SIGMA[r % 10];
        g(&mut v, 0, 4, 8, 12, m[s[0]], m[s[1]]);
        g(&mut v, 1, 5, 9, 13, m[s[2]], m[s[3]]);
        g(&mut v, 2, 6, 10, 14, m[s[4]], m[s[5]]);
        g(&mut v, 3, 7, 11, 15, m[s[6]], m[s[7]]);
        g(&mut v, 0, 5, 10, 15, m[s[8]], m[s[9]]);
        g(&mut v, 1, 6, 11, 12, m[s[10]], m[s[11]]);
        g(&mut v, 2, 7, 8, 13, m[s[12]], m[s[13]]);
        g(&mut v, 3, 4, 9, 14, m[s[14]], m[s[15]]);
    }
    for i in 0..8 {
        h[i] ^= v[i] ^ v[i + 8];
    }
}

/// Unkeyed BLAKE2b (RFC 7693) with an `N`-byte digest, `1 <= N <= 64`.
pub(crate) fn blake2b<const N: usize>(data: &[u8]) -> [u8; N] {
    const { assert!(N >= 1 && N <= 64) };
    let mut h = IV;
    h[0] ^= 0x0101_0000 ^ N as u64;
    let mut block = [0u8; 128];
    let mut off = 0usize;
    // Every full block but the last is compressed as not-last; the last (possibly partial or empty)
    // block is zero-padded and carries the final flag.
    while data.len() - off > 128 {
        block.copy_from_slice(&data[off..off + 128]);
        off += 128;
        compress(&mut h, &block, off as u128, false);
    }
    block = [0u8; 128];
    block[..data.len() - off].copy_from_slice(&data[off..]);
    compress(&mut h, &block, data.len() as u128, true);
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        *o = h[i / 8].to_le_bytes()[i % 8];
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    #[test]
    fn blake2b_matches_rfc7693_and_python() {
        // RFC 7693 Appendix A: BLAKE2b-512("abc").
        assert_eq!(
            hex(&blake2b::<64>(b"abc")),
            "ba80a53f981c4d0d6a2797b69f12f6e94c212f14685ac4b74b12bb6fdbffa2d1\
             7d87c5392aab792dc252d5de4533cc9518d38aa8dbf1925ab92386edd4009923"
        );
        // Values from python3: hashlib.blake2b(x, digest_size=6).hexdigest().
        assert_eq!(hex(&blake2b::<6>(b"")), "ddd9c40767f9");
        assert_eq!(hex(&blake2b::<6>(&[b'x'; 128])), "8862785c020e");
        assert_eq!(hex(&blake2b::<6>(&[b'y'; 300])), "c57a59a0e4cf");
    }

    #[test]
    fn site_hash_matches_capture_py() {
        let frames = vec![
            Frame {
                filename: "model.py".into(),
                line: 42,
                name: "forward".into(),
            },
            Frame {
                filename: "train.py".into(),
                line: 7,
                name: "<module>".into(),
            },
        ];
        // python3: int.from_bytes(hashlib.blake2b(b"model.py:42:forward|train.py:7:<module>",
        //          digest_size=6).digest(), "little")
        assert_eq!(site_hash(&frames), PY_SITE);
        assert_eq!(site_hash(&[]), 0);
        assert!(site_hash(&frames) < 1 << 48);
    }

    const PY_SITE: u64 = 190_794_870_479_121;
}
