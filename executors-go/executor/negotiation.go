package executor

// ProtocolVersions are the protocol revisions this SDK speaks, announced in
// its Hello (protocol_versions). 1.1 adds negotiation: the Hello's revisions,
// features and frame limit, and the Job's negotiated revision, features and
// the supervisor's frame limit (PROTOCOL.md, "Handshake and negotiation").
var ProtocolVersions = []string{"1.0", "1.1"}

// FeatureFrameLimits is the feature this SDK announces: it holds a job's
// frames to the supervisor's limit (Job.max_frame_bytes) and replaces a
// terminal over it with RESULT_TOO_LARGE.
const FeatureFrameLimits = "frame_limits"
