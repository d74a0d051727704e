//! Protocol negotiation (revision 1.1, PROTOCOL.md "Handshake"): the hello
//! lists the revisions and features an executor speaks and the largest frame
//! it accepts; the supervisor picks the highest common revision and the common
//! features, and states them, with its own frame limit, in every job. Pure.
//!
//! A 1.0 hello (none of the new fields) negotiates 1.0 with no features and
//! the default frame limit: its jobs carry none of the new fields, so a 1.0
//! executor sees exactly the frames it always did.

use std::fmt;

use super::{Hello, Job, DEFAULT_MAX_FRAME_BYTES};

/// A protocol revision, "MAJOR.MINOR".
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Revision {
    pub major: u32,
    pub minor: u32,
}

impl Revision {
    pub const V1_0: Revision = Revision { major: 1, minor: 0 };
    pub const V1_1: Revision = Revision { major: 1, minor: 1 };

    /// Parses `"1.1"`; anything else (`"1"`, `"v1.1"`, `"1.1.0"`) is `None`.
    pub fn parse(s: &str) -> Option<Revision> {
        let (major, minor) = s.split_once('.')?;
        let digits = |p: &str| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit());
        if !digits(major) || !digits(minor) {
            return None;
        }
        Some(Revision {
            major: major.parse().ok()?,
            minor: minor.parse().ok()?,
        })
    }
}

impl fmt::Display for Revision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// The revisions this supervisor speaks, lowest first.
pub const SUPPORTED_REVISIONS: [Revision; 2] = [Revision::V1_0, Revision::V1_1];

/// The executor honours `Job.max_frame_bytes`: a terminal over it becomes
/// `RESULT_TOO_LARGE`.
pub const FEATURE_FRAME_LIMITS: &str = "frame_limits";

/// The features this supervisor knows, sorted.
pub const SUPPORTED_FEATURES: [&str; 1] = [FEATURE_FRAME_LIMITS];

/// The code of a hello with no revision in common (not retryable: respawning
/// the same executor cannot fix it).
pub const VERSION_MISMATCH_CODE: &str = "PROTOCOL_VERSION_MISMATCH";

/// The code of a job whose frame is over the executor's announced limit (not
/// retryable: the same job is as large next time).
pub const JOB_TOO_LARGE_CODE: &str = "JOB_TOO_LARGE";

/// What the supervisor offers: its revisions, features and frame limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SupervisorOffer {
    /// Lowest first.
    pub revisions: Vec<Revision>,
    pub features: Vec<String>,
    /// The largest frame body the supervisor accepts from an executor.
    pub max_frame_bytes: u64,
}

impl SupervisorOffer {
    /// This supervisor's offer with its configured frame cap.
    pub fn new(max_frame_bytes: usize) -> SupervisorOffer {
        SupervisorOffer {
            revisions: SUPPORTED_REVISIONS.to_vec(),
            features: SUPPORTED_FEATURES.iter().map(|f| f.to_string()).collect(),
            max_frame_bytes: max_frame_bytes as u64,
        }
    }
}

/// What both sides agreed on for one executor process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Agreement {
    pub revision: Revision,
    /// Sorted, no duplicates.
    pub features: Vec<String>,
    /// The largest frame body the supervisor may send to the executor.
    pub executor_max_frame_bytes: u64,
    /// The largest frame body the executor may send (the supervisor's cap).
    pub supervisor_max_frame_bytes: u64,
}

impl Agreement {
    /// Whether the agreed revision carries the 1.1 job fields.
    pub fn negotiated(&self) -> bool {
        self.revision >= Revision::V1_1
    }

    pub fn has_feature(&self, name: &str) -> bool {
        self.features.iter().any(|f| f == name)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NegotiationError {
    #[error(
        "no protocol revision in common: the executor speaks {}, this supervisor speaks {}. {}",
        list(.executor), list(.supervisor), no_common_advice(.executor)
    )]
    NoCommonRevision {
        executor: Vec<String>,
        supervisor: Vec<String>,
    },
    #[error(
        "the job frame is {len} bytes, over the {limit}-byte limit {}; {}",
        if *.announced { "the executor announced (Hello.max_frame_bytes)" }
        else { "of an executor that announces none (the default; Hello.max_frame_bytes raises it)" },
        too_large_hint(*.checkpoint)
    )]
    JobTooLarge {
        len: u64,
        limit: u64,
        /// The limit is the executor's own (else the default 8 MiB).
        announced: bool,
        /// Bytes of it that are the checkpoint an earlier attempt reported.
        checkpoint: u64,
    },
}

impl NegotiationError {
    /// The attempt's stable error code (PROTOCOL.md); both are not retryable.
    pub fn code(&self) -> &'static str {
        match self {
            NegotiationError::NoCommonRevision { .. } => VERSION_MISMATCH_CODE,
            NegotiationError::JobTooLarge { .. } => JOB_TOO_LARGE_CODE,
        }
    }
}

/// What to do about a job too large: a checkpoint an earlier attempt
/// reported can be most of it (volume audit: a checkpoint a few hundred bytes
/// under the limit was stored, and every later attempt failed with advice
/// about input artifacts).
fn too_large_hint(checkpoint: u64) -> String {
    if checkpoint > 0 {
        format!(
            "{checkpoint} bytes of it are the checkpoint an earlier attempt reported: a \
             checkpoint must leave room for the job's other fields (input, secrets, artifact refs)"
        )
    } else {
        "pass large data as input artifacts".into()
    }
}

/// Revisions for a message: each as it is when it looks like one (`1.0`),
/// else quoted, so that an empty or odd string shows (SDK audit: `["", ""]`
/// read "the executor speaks , ,").
/// What to do when no revision is in common: fix the entries that are no
/// revision at all (`"v1.1"`, `"1.1.0"`: third-party audit, told to upgrade
/// an SDK that was not the problem), else upgrade one side.
fn no_common_advice(executor: &[String]) -> String {
    let bad: Vec<String> = executor
        .iter()
        .filter(|v| Revision::parse(v.trim()).is_none())
        .cloned()
        .collect();
    if bad.is_empty() {
        "Upgrade the executor's SDK or the supervisor".into()
    } else {
        format!(
            "{} {} no revision: Hello.protocol_versions lists \"MAJOR.MINOR\" strings, such as \"1.0\" and \"1.1\"",
            bad.iter().map(|v| format!("{v:?}")).collect::<Vec<_>>().join(", "),
            if bad.len() == 1 { "is" } else { "are" }
        )
    }
}

fn list(v: &[String]) -> String {
    if v.is_empty() {
        return "nothing".into();
    }
    v.iter()
        .map(|r| {
            if !r.is_empty() && r.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
                r.clone()
            } else {
                format!("{r:?}")
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Agrees on a revision, features and frame limits with the executor that
/// said `hello`: the highest revision both speak (an empty list means 1.0;
/// entries that are not "MAJOR.MINOR" are ignored), the features both know,
/// the executor's frame limit (0: the default 8 MiB).
pub fn negotiate(hello: &Hello, offer: &SupervisorOffer) -> Result<Agreement, NegotiationError> {
    let executor: Vec<Revision> = if hello.protocol_versions.is_empty() {
        vec![Revision::V1_0]
    } else {
        hello
            .protocol_versions
            .iter()
            .filter_map(|v| Revision::parse(v.trim()))
            .collect()
    };
    let Some(revision) = offer
        .revisions
        .iter()
        .copied()
        .filter(|r| executor.contains(r))
        .max()
    else {
        return Err(NegotiationError::NoCommonRevision {
            executor: hello.protocol_versions.clone(),
            supervisor: offer.revisions.iter().map(Revision::to_string).collect(),
        });
    };
    let mut features: Vec<String> = if revision >= Revision::V1_1 {
        offer
            .features
            .iter()
            .filter(|f| hello.features.contains(f))
            .cloned()
            .collect()
    } else {
        Vec::new()
    };
    features.sort();
    features.dedup();
    let executor_max_frame_bytes = match hello.max_frame_bytes {
        0 => DEFAULT_MAX_FRAME_BYTES as u64,
        n => n,
    };
    Ok(Agreement {
        revision,
        features,
        executor_max_frame_bytes,
        supervisor_max_frame_bytes: offer.max_frame_bytes,
    })
}

/// The job as it is sent to the executor that said `hello`: negotiated (the
/// agreement stated in it), and checked against the executor's frame limit
/// before anything is written.
pub fn prepare_job(
    hello: &Hello,
    offer: &SupervisorOffer,
    job: &Job,
) -> Result<Job, NegotiationError> {
    let agreement = negotiate(hello, offer)?;
    let mut job = job.clone();
    job.agreement = Some(agreement.clone());
    let len = super::job_frame_len(&job);
    if len > agreement.executor_max_frame_bytes {
        return Err(NegotiationError::JobTooLarge {
            len,
            limit: agreement.executor_max_frame_bytes,
            announced: hello.max_frame_bytes > 0,
            checkpoint: job.checkpoint.as_ref().map_or(0, |c| c.len() as u64),
        });
    }
    Ok(job)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Entries that are no revision are named with the format revisions
    /// have; real revisions with none in common ask for an upgrade.
    #[test]
    fn no_common_revision_says_what_a_revision_looks_like() {
        let offer = SupervisorOffer::new(1 << 20);
        let e = negotiate(&hello(&["v1.1", "1.1.0"], &[], 0), &offer).expect_err("none");
        let msg = e.to_string();
        assert!(
            msg.contains("\"v1.1\", \"1.1.0\" are no revision") && msg.contains("\"MAJOR.MINOR\""),
            "{msg}"
        );
        assert!(!msg.contains("Upgrade"), "{msg}");
        let e = negotiate(&hello(&["2.0"], &[], 0), &offer).expect_err("none");
        assert!(
            e.to_string()
                .ends_with("Upgrade the executor's SDK or the supervisor"),
            "{e}"
        );
    }

    #[test]
    fn revisions_that_are_not_ones_are_quoted_in_messages() {
        assert_eq!(list(&["1.0".into(), "1.1".into()]), "1.0, 1.1");
        assert_eq!(list(&["".into(), "banana".into()]), "\"\", \"banana\"");
        assert_eq!(list(&[]), "nothing");
    }
    use crate::wire::ToExecutor;

    fn hello(versions: &[&str], features: &[&str], max_frame_bytes: u64) -> Hello {
        Hello {
            protocol_version: super::super::PROTOCOL_VERSION,
            executor_kind: "go".into(),
            kinds: vec!["demo.echo".into()],
            labels: Default::default(),
            sdk_name: "t".into(),
            sdk_version: "0".into(),
            max_jobs_per_process: 1,
            pid: 1,
            protocol_versions: versions.iter().map(|s| s.to_string()).collect(),
            features: features.iter().map(|s| s.to_string()).collect(),
            max_frame_bytes,
        }
    }

    const MIB8: u64 = DEFAULT_MAX_FRAME_BYTES as u64;

    #[test]
    fn the_table() {
        let offer = SupervisorOffer::new(1 << 20);
        // (versions, features, hello max, expected revision / features / executor max, or the error code)
        type Want = Result<(&'static str, &'static [&'static str], u64), &'static str>;
        let table: &[(&[&str], &[&str], u64, Want)] = &[
            // a 1.0 hello: no new fields
            (&[], &[], 0, Ok(("1.0", &[], MIB8))),
            // features without a 1.1 revision are not agreed (1.0 has none)
            (&[], &["frame_limits"], 0, Ok(("1.0", &[], MIB8))),
            (&["1.0"], &["frame_limits"], 4096, Ok(("1.0", &[], 4096))),
            (
                &["1.0", "1.1"],
                &["frame_limits"],
                4096,
                Ok(("1.1", &["frame_limits"], 4096)),
            ),
            // order does not matter; the highest common wins
            (&["1.1", "1.0"], &[], 0, Ok(("1.1", &[], MIB8))),
            (
                &["1.1"],
                &["frame_limits", "frame_limits"],
                0,
                Ok(("1.1", &["frame_limits"], MIB8)),
            ),
            // unknown features are ignored, unknown revisions too when one is common
            (
                &["1.0", "1.1", "1.7", "2.0"],
                &["zstd", "frame_limits"],
                0,
                Ok(("1.1", &["frame_limits"], MIB8)),
            ),
            (
                &[" 1.1 ", "garbage", "1", "1.1.0"],
                &[],
                0,
                Ok(("1.1", &[], MIB8)),
            ),
            // nothing in common
            (&["1.7"], &[], 0, Err(VERSION_MISMATCH_CODE)),
            (
                &["2.0", "2.1"],
                &["frame_limits"],
                0,
                Err(VERSION_MISMATCH_CODE),
            ),
            (&["garbage"], &[], 0, Err(VERSION_MISMATCH_CODE)),
            (&["v1.1"], &[], 0, Err(VERSION_MISMATCH_CODE)),
        ];
        for (versions, features, max, want) in table {
            let got = negotiate(&hello(versions, features, *max), &offer);
            match (want, got) {
                (Ok((rev, feats, emax)), Ok(a)) => {
                    assert_eq!(a.revision.to_string(), *rev, "{versions:?}");
                    assert_eq!(a.features, feats.to_vec(), "{versions:?} {features:?}");
                    assert_eq!(a.executor_max_frame_bytes, *emax, "{versions:?}");
                    assert_eq!(a.supervisor_max_frame_bytes, 1 << 20);
                    assert_eq!(a.negotiated(), *rev != "1.0");
                }
                (Err(code), Err(e)) => {
                    assert_eq!(e.code(), *code, "{versions:?}");
                    assert!(e.to_string().contains("1.0, 1.1"), "{e}");
                }
                (want, got) => panic!("{versions:?} {features:?}: want {want:?}, got {got:?}"),
            }
        }
    }

    #[test]
    fn revisions_parse_strictly() {
        assert_eq!(Revision::parse("1.1"), Some(Revision::V1_1));
        assert_eq!(
            Revision::parse("10.02"),
            Some(Revision {
                major: 10,
                minor: 2
            })
        );
        for bad in [
            "",
            "1",
            "1.",
            ".1",
            "1.1.0",
            "+1.1",
            "1.-1",
            "a.b",
            "99999999999.0",
        ] {
            assert_eq!(Revision::parse(bad), None, "{bad:?}");
        }
        assert!(Revision::V1_0 < Revision::V1_1);
        assert!(
            Revision {
                major: 1,
                minor: 10
            } > Revision { major: 1, minor: 9 }
        );
    }

    fn job(input_len: usize) -> Job {
        Job {
            job_id: "j".into(),
            workflow_run_id: "w".into(),
            step_run_id: "s".into(),
            idempotency_key: "k".into(),
            executor_kind: "go".into(),
            kind: "demo.echo".into(),
            attempt: 1,
            deadline_unix_ms: 0,
            attempt_deadline_unix_ms: 0,
            heartbeat_timeout_ms: 0,
            input: vec![b'1'; input_len],
            input_artifacts: Vec::new(),
            checkpoint: None,
            output_dir: "/tmp/x".into(),
            secrets: Default::default(),
            labels: Default::default(),
            agreement: None,
        }
    }

    #[test]
    fn the_job_carries_the_agreement_only_from_1_1_and_respects_the_executor_limit() {
        let offer = SupervisorOffer::new(1 << 20);
        // 1.0: the job's frame is exactly a 1.0 job's
        let v1 = prepare_job(&hello(&[], &[], 0), &offer, &job(10)).expect("1.0");
        let plain = super::super::encode_to_executor(&ToExecutor::Job(Box::new(job(10))));
        assert_eq!(
            super::super::encode_to_executor(&ToExecutor::Job(Box::new(v1.clone()))),
            plain
        );
        assert_eq!(
            v1.agreement.as_ref().map(|a| a.revision),
            Some(Revision::V1_0)
        );

        // 1.1: the three fields are on the wire
        let v11 = prepare_job(
            &hello(&["1.0", "1.1"], &["frame_limits"], 0),
            &offer,
            &job(10),
        )
        .expect("1.1");
        let frame = super::super::pb::SupervisorFrame::from(&ToExecutor::Job(Box::new(v11)));
        let Some(super::super::pb::supervisor_frame::Frame::Job(pj)) = frame.frame else {
            panic!("not a job")
        };
        assert_eq!(pj.negotiated_version, "1.1");
        assert_eq!(pj.negotiated_features, vec!["frame_limits".to_string()]);
        assert_eq!(pj.max_frame_bytes, 1 << 20);

        // the executor's limit: the job body at the limit goes, one byte over does not
        let len = super::super::frame_body_len(&ToExecutor::Job(Box::new(
            prepare_job(&hello(&["1.1"], &[], 0), &offer, &job(1000)).expect("fits"),
        )));
        assert!(prepare_job(&hello(&["1.1"], &[], len), &offer, &job(1000)).is_ok());
        let err = prepare_job(&hello(&["1.1"], &[], len - 1), &offer, &job(1000))
            .expect_err("one byte over");
        assert_eq!(err.code(), JOB_TOO_LARGE_CODE);
        assert_eq!(
            err,
            NegotiationError::JobTooLarge {
                len,
                limit: len - 1,
                announced: true,
                checkpoint: 0,
            }
        );
        // a checkpoint that leaves no room is named as the cause
        let mut resumed = job(1000);
        resumed.checkpoint = Some(vec![7; 900]);
        let err = prepare_job(&hello(&["1.1"], &[], len), &offer, &resumed)
            .expect_err("the checkpoint leaves no room");
        let msg = err.to_string();
        assert!(
            msg.contains("900 bytes of it are the checkpoint an earlier attempt reported"),
            "{msg}"
        );
        assert!(!msg.contains("input artifacts"), "{msg}");
        // a 1.0 executor's limit is the default 8 MiB, and the message does
        // not say it announced one
        let big = job(DEFAULT_MAX_FRAME_BYTES);
        let err = prepare_job(&hello(&[], &[], 0), &offer, &big).expect_err("over 8 MiB");
        assert_eq!(err.code(), JOB_TOO_LARGE_CODE);
        assert!(
            err.to_string().contains("an executor that announces none"),
            "{err}"
        );
        // a mismatch wins over the size
        assert_eq!(
            prepare_job(&hello(&["3.0"], &[], 1), &offer, &job(10)).map_err(|e| e.code()),
            Err(VERSION_MISMATCH_CODE)
        );
    }
}
