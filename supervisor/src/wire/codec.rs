//! Varint-delimited frames: a base-128 varint byte length, then the message.
//! The length is checked against the cap before anything is allocated for the
//! body; a clean EOF (between frames) is told apart from a truncated frame.

use std::marker::PhantomData;
use std::time::{Duration, Instant};

use bytes::{Buf, BytesMut};
use prost::Message;
use tokio_util::codec::Decoder;

use super::{first_bytes, WireError};

/// Default cap on one frame (PROTOCOL.md).
pub const DEFAULT_MAX_FRAME_BYTES: usize = 8 * 1024 * 1024;

/// Decodes frames of message type `M` from a byte stream.
#[derive(Debug)]
pub struct FrameDecoder<M> {
    max: usize,
    /// Bytes of the whole frames decoded so far, prefixes included.
    consumed: u64,
    /// Bytes buffered at the last decode, and when that number last
    /// changed: a frame begun that still grows is on its way, one that
    /// stopped is stuck (most often text printed to stdout).
    seen: usize,
    changed_at: Option<Instant>,
    _m: PhantomData<fn() -> M>,
}

impl<M> FrameDecoder<M> {
    pub fn new(max: usize) -> Self {
        FrameDecoder {
            max,
            consumed: 0,
            seen: 0,
            changed_at: None,
            _m: PhantomData,
        }
    }

    /// How long the bytes buffered (a frame begun, not complete) have been
    /// as they are: `None` with nothing buffered. Short while a frame is
    /// still arriving; long for one that stopped.
    pub fn unchanged_for(&self) -> Option<Duration> {
        self.changed_at.map(|t| t.elapsed())
    }

    fn note_buffered(&mut self, len: usize) {
        if len == 0 {
            self.changed_at = None;
        } else if len != self.seen || self.changed_at.is_none() {
            self.changed_at = Some(Instant::now());
        }
        self.seen = len;
    }

    /// Bytes of the whole frames decoded so far (prefixes included).
    pub fn consumed(&self) -> u64 {
        self.consumed
    }
}

/// Reads a varint prefix: `Ok(None)` when more bytes are needed,
/// `Ok(Some((value, prefix_len)))` when complete.
pub(super) fn read_varint(buf: &[u8]) -> Result<Option<(u64, usize)>, String> {
    let mut value: u64 = 0;
    for (i, &b) in buf.iter().enumerate().take(10) {
        if i == 9 && b > 1 {
            return Err("length prefix overflows 64 bits".into());
        }
        value |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return Ok(Some((value, i + 1)));
        }
    }
    if buf.len() >= 10 {
        return Err("length prefix longer than 10 bytes".into());
    }
    Ok(None)
}

impl<M: Message + Default> Decoder for FrameDecoder<M> {
    type Item = M;
    type Error = WireError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<M>, WireError> {
        let res = self.decode_one(src);
        self.note_buffered(src.len());
        res
    }

    fn decode_eof(&mut self, src: &mut BytesMut) -> Result<Option<M>, WireError> {
        match self.decode(src)? {
            Some(m) => Ok(Some(m)),
            None if src.is_empty() => Ok(None),
            None => Err(WireError::Truncated {
                buffered: src.len(),
                first_bytes: first_bytes(src, 32),
            }),
        }
    }
}

/// How many of a frame's first bytes its errors read: 32 shown (and
/// whether there are more), and what [`super::looks_printed`] reads (16
/// bytes of text, or a frame's length, tag and inner length: at most 21).
const HEAD: usize = 33;

impl<M: Message + Default> FrameDecoder<M> {
    fn decode_one(&mut self, src: &mut BytesMut) -> Result<Option<M>, WireError> {
        let (len, prefix) = match read_varint(src) {
            Ok(Some(v)) => v,
            Ok(None) => return Ok(None),
            Err(reason) => {
                return Err(WireError::Malformed {
                    reason,
                    first_bytes: first_bytes(src, 32),
                    printed: false,
                })
            }
        };
        if len > self.max as u64 {
            return Err(WireError::TooLarge {
                len,
                cap: self.max,
                printed: super::looks_printed(src),
            });
        }
        let len = len as usize;
        if src.len() < prefix + len {
            // reserve only what a frame within the cap needs
            src.reserve(prefix + len - src.len());
            return Ok(None);
        }
        // the frame's first bytes, kept for an error's evidence and its
        // print judgement (both read at most this many): judged only when
        // needed, not for every frame
        let mut head = [0u8; HEAD];
        let kept = (prefix + len).min(HEAD);
        head[..kept].copy_from_slice(&src[..kept]);
        let head = &head[..kept];
        let malformed = |reason: String| WireError::Malformed {
            reason,
            first_bytes: first_bytes(head, 32),
            printed: super::looks_printed(head),
        };
        self.consumed += (prefix + len) as u64;
        src.advance(prefix);
        let body = src.split_to(len);
        match M::decode(body.freeze()) {
            // text that decodes, as fields no protocol has (`xx…`: field 15,
            // 120, again and again), is no frame of an unknown kind but a
            // print (re-check audit 106: a line of 300 `x` read as "a frame
            // of no known kind"); a binary frame of a kind this supervisor
            // does not know stays one
            Ok(m) if len > 0 && m.encoded_len() == 0 && super::looks_printed(head) => {
                Err(malformed("it holds no field of the protocol".into()))
            }
            Ok(m) => Ok(Some(m)),
            Err(e) => Err(malformed(e.to_string())),
        }
    }
}

/// Encodes one message as a delimited frame.
pub fn encode_frame<M: Message>(m: &M) -> Vec<u8> {
    m.encode_length_delimited_to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::pb;

    fn hello() -> pb::ExecutorFrame {
        pb::ExecutorFrame {
            frame: Some(pb::executor_frame::Frame::Hello(pb::Hello {
                protocol_version: 1,
                executor_kind: "go".into(),
                kinds: vec!["demo.echo".into()],
                ..Default::default()
            })),
        }
    }

    /// A frame begun is timed from its last growth, so a stop can tell one
    /// on its way from one that stopped; nothing buffered, nothing timed.
    #[test]
    fn a_begun_frame_is_timed_from_its_last_growth() {
        let bytes = encode_frame(&hello());
        let mut d = FrameDecoder::<pb::ExecutorFrame>::new(1024);
        assert_eq!(d.unchanged_for(), None);
        let mut buf = BytesMut::from(&bytes[..3]);
        assert!(d.decode(&mut buf).expect("decode").is_none());
        let first = d.unchanged_for().expect("a frame begun is timed");
        std::thread::sleep(Duration::from_millis(30));
        // no new byte: the same frame, older
        assert!(d.decode(&mut buf).expect("decode").is_none());
        assert!(d.unchanged_for().expect("timed") >= first + Duration::from_millis(30));
        // it grows: timed afresh
        buf.extend_from_slice(&bytes[3..bytes.len() - 1]);
        assert!(d.decode(&mut buf).expect("decode").is_none());
        assert!(d.unchanged_for().expect("timed") < Duration::from_millis(30));
        // complete: nothing buffered, nothing timed
        buf.extend_from_slice(&bytes[bytes.len() - 1..]);
        assert!(d.decode(&mut buf).expect("decode").is_some());
        assert_eq!(d.unchanged_for(), None);
    }

    #[test]
    fn round_trips_and_splits_at_any_byte() {
        let mut bytes = encode_frame(&hello());
        bytes.extend(encode_frame(&hello()));
        for cut in 0..bytes.len() {
            let mut d = FrameDecoder::<pb::ExecutorFrame>::new(1024);
            let mut buf = BytesMut::from(&bytes[..cut]);
            let mut got = Vec::new();
            while let Some(m) = d.decode(&mut buf).expect("decode") {
                got.push(m);
            }
            buf.extend_from_slice(&bytes[cut..]);
            while let Some(m) = d.decode(&mut buf).expect("decode") {
                got.push(m);
            }
            assert_eq!(got, vec![hello(), hello()], "cut at {cut}");
        }
    }

    #[test]
    fn clean_eof_versus_truncated() {
        let bytes = encode_frame(&hello());
        let mut d = FrameDecoder::<pb::ExecutorFrame>::new(1024);
        let mut empty = BytesMut::new();
        assert!(d.decode_eof(&mut empty).expect("clean eof").is_none());
        let mut partial = BytesMut::from(&bytes[..bytes.len() - 1]);
        assert!(matches!(
            d.decode_eof(&mut partial),
            Err(WireError::Truncated { .. })
        ));
        let mut half_varint = BytesMut::from(&[0x80u8][..]);
        assert!(matches!(
            d.decode_eof(&mut half_varint),
            Err(WireError::Truncated { .. })
        ));
    }

    #[test]
    fn oversize_is_refused_before_allocating() {
        let mut d = FrameDecoder::<pb::ExecutorFrame>::new(1024);
        // announces 64 MiB
        let mut buf = BytesMut::from(&[0x80u8, 0x80, 0x80, 0x20, 1, 2, 3][..]);
        let cap_before = buf.capacity();
        assert!(matches!(
            d.decode(&mut buf),
            Err(WireError::TooLarge {
                len: 67_108_864,
                cap: 1024,
                printed: false
            })
        ));
        assert_eq!(buf.capacity(), cap_before);
    }

    /// Lines printed to stdout now and then: the first byte (`s`, 115)
    /// reads as a length, later lines fill it, and the "frame" fails to
    /// decode. The error says it is all text, most likely printed (audit 99:
    /// a print every 200 ms read as a malformed frame and nothing more);
    /// binary garbage does not.
    #[test]
    fn a_malformed_frame_of_printed_lines_says_it_is_text() {
        let mut d = FrameDecoder::<pb::ExecutorFrame>::new(1 << 20);
        let mut buf = BytesMut::new();
        let mut n = 0;
        let err = loop {
            n += 1;
            buf.extend_from_slice(format!("step {n} of 40: loading\n").as_bytes());
            match d.decode(&mut buf) {
                Ok(None) => assert!(n < 20, "never complete"),
                Ok(Some(f)) => panic!("decoded text as {f:?}"),
                Err(e) => break e,
            }
        };
        assert!(
            matches!(&err, WireError::Malformed { printed: true, first_bytes, .. }
                     if first_bytes.starts_with("step 1 of 40")),
            "{err:?}"
        );
        assert!(
            err.to_string()
                .contains("it is all text, most likely printed to stdout"),
            "{err}"
        );

        // a print, then the executor's real frame: one "frame" of text,
        // then binary (`p` is a length of 112)
        let mut d = FrameDecoder::<pb::ExecutorFrame>::new(1 << 20);
        let mut buf = BytesMut::new();
        for n in 0..5 {
            buf.extend_from_slice(format!("progress line {n}\n").as_bytes());
        }
        let result = hello();
        for _ in 0..3 {
            buf.extend_from_slice(&encode_frame(&result));
        }
        let err = d.decode(&mut buf).expect_err("text, then a frame");
        assert!(
            matches!(&err, WireError::Malformed { printed: true, .. }),
            "{err:?}"
        );
        // a line that begins with a non-ASCII character announces 67 MB,
        // a short one too, with the executor's real frame behind it
        let mut d = FrameDecoder::<pb::ExecutorFrame>::new(1 << 20);
        let mut short =
            BytesMut::from(&["✓ done\n".as_bytes(), &encode_frame(&result)].concat()[..]);
        let err = d.decode(&mut short).expect_err("too large");
        assert!(
            matches!(&err, WireError::TooLarge { printed: true, .. }),
            "{err:?}"
        );
        let mut d = FrameDecoder::<pb::ExecutorFrame>::new(1 << 20);
        let mut tick = BytesMut::from("✓ step 1 done\n".as_bytes());
        let err = d.decode(&mut tick).expect_err("too large");
        assert!(
            matches!(&err, WireError::TooLarge { printed: true, .. }),
            "{err:?}"
        );
        assert!(err.to_string().contains("most likely printed"), "{err}");
        // a line that decodes as fields no protocol has (`x` is field 15)
        let mut d = FrameDecoder::<pb::ExecutorFrame>::new(1 << 20);
        let mut xs = BytesMut::from(
            &[
                format!("{}\n", "x".repeat(300)).as_bytes(),
                &encode_frame(&result),
            ]
            .concat()[..],
        );
        let err = d.decode(&mut xs).expect_err("a print");
        assert!(
            matches!(&err, WireError::Malformed { printed: true, .. }),
            "{err:?}"
        );
        // an empty frame (no kind) and a frame of a kind to come stay frames
        let mut d = FrameDecoder::<pb::ExecutorFrame>::new(1 << 20);
        let mut empty = BytesMut::from(&b"\x00\x03\x2a\x01\x07"[..]);
        assert!(matches!(d.decode(&mut empty), Ok(Some(_))));
        assert!(
            matches!(d.decode(&mut empty), Ok(Some(_))),
            "field 5, a kind to come"
        );
        // a real frame's start is no print, whatever its bytes
        assert!(!super::super::looks_printed(&encode_frame(&result)));

        let mut d = FrameDecoder::<pb::ExecutorFrame>::new(1 << 20);
        let mut bin = BytesMut::from(&b"\x05\x0a\xff\xff\xff\xff"[..]);
        let err = d.decode(&mut bin).expect_err("garbage");
        assert!(
            matches!(err, WireError::Malformed { printed: false, .. }),
            "{err:?}"
        );
        assert!(!err.to_string().contains("printed"), "{err}");
    }

    #[test]
    fn garbage_is_an_error() {
        let mut d = FrameDecoder::<pb::ExecutorFrame>::new(1 << 20);
        let mut buf = BytesMut::from(&b"\x05\xff\xff\xff\xff\xff"[..]);
        assert!(matches!(
            d.decode(&mut buf),
            Err(WireError::Malformed { .. })
        ));
        let mut long = BytesMut::from(&[0xffu8; 11][..]);
        assert!(matches!(
            d.decode(&mut long),
            Err(WireError::Malformed { .. })
        ));
    }
}

/// The decoder against arbitrary input: random bytes and mutations of valid
/// frames. It never panics, never allocates past the cap, and every bad input
/// is an error (or a clean "need more bytes" at most).
#[cfg(test)]
mod fuzz {
    use super::*;
    use crate::wire::pb;
    use rand::{Rng, SeedableRng};

    fn valid_stream() -> Vec<u8> {
        let mut out = Vec::new();
        for i in 0..4u64 {
            out.extend(encode_frame(&pb::ExecutorFrame {
                frame: Some(pb::executor_frame::Frame::Event(pb::ProgressEvent {
                    job_id: "j".into(),
                    sequence: i + 1,
                    kind: 3,
                    message: "x".repeat(i as usize * 40),
                    fraction: Some(0.5),
                    checkpoint: Some(vec![i as u8; 8]),
                    at_unix_ms: 1,
                })),
            }));
        }
        out
    }

    fn run(bytes: &[u8], cap: usize) {
        let mut d = FrameDecoder::<pb::ExecutorFrame>::new(cap);
        let mut buf = BytesMut::new();
        // feed in irregular chunks, as a pipe would
        let mut i = 0;
        let mut chunk = 1;
        while i < bytes.len() {
            let end = (i + chunk).min(bytes.len());
            buf.extend_from_slice(&bytes[i..end]);
            i = end;
            chunk = chunk % 97 + 3;
            loop {
                match d.decode(&mut buf) {
                    Ok(Some(_)) => continue,
                    Ok(None) => break,
                    Err(_) => return,
                }
            }
            assert!(
                buf.capacity() <= cap + 64 + bytes.len().min(8192),
                "buffer grew past the cap"
            );
        }
        let _ = d.decode_eof(&mut buf);
    }

    #[test]
    fn random_and_mutated_input_never_panics() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed);
        let valid = valid_stream();
        for _ in 0..20_000 {
            let len = rng.random_range(0..600);
            let random: Vec<u8> = (0..len).map(|_| rng.random()).collect();
            run(&random, 1024);
            let mut m = valid.clone();
            for _ in 0..rng.random_range(1..6) {
                let at = rng.random_range(0..m.len());
                match rng.random_range(0..3) {
                    0 => m[at] = rng.random(),
                    1 => {
                        m.remove(at);
                    }
                    _ => m.insert(at, rng.random()),
                }
            }
            run(&m, 1024);
            m.truncate(rng.random_range(0..m.len()));
            run(&m, 1024);
        }
    }

    #[test]
    fn every_cut_of_a_valid_stream_is_truncated_or_clean() {
        let valid = valid_stream();
        for cut in 0..=valid.len() {
            let mut d = FrameDecoder::<pb::ExecutorFrame>::new(1 << 20);
            let mut buf = BytesMut::from(&valid[..cut]);
            let mut frames = 0;
            loop {
                match d.decode_eof(&mut buf) {
                    Ok(Some(_)) => frames += 1,
                    Ok(None) => break,
                    Err(WireError::Truncated { .. }) => break,
                    Err(e) => panic!("cut {cut}: unexpected {e}"),
                }
            }
            assert!(frames <= 4);
        }
    }
}
