package executor

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"sort"
	"strings"
)

// redactedMarker replaces a secret value.
const redactedMarker = "[REDACTED]"

// minRedactLen is the supervisor's MIN_REDACT_LEN: a value at least this long
// is replaced wherever it occurs; a shorter one only where it is the whole
// string (replacing "42" inside every number would garble the text and say
// where the secret is).
const minRedactLen = 4

// redactor replaces the secret values handed to one job. The rules are the
// supervisor's (supervisor/src/secrets.rs, Redactor), so that what the SDK
// sends is what the supervisor would store:
//
//  1. every value of at least minRedactLen bytes, and its JSON-escaped and
//     percent-encoded forms, is replaced wherever it occurs, scanning left to
//     right and taking the longest value at each position;
//  2. a shorter non-empty value is replaced only where it is the whole
//     string; an empty value never;
//  3. if the result still contains a value (values overlapping each other),
//     the whole string is replaced.
//
// The supervisor's marker names the secret ("[REDACTED:TOKEN]"); the SDKs
// write "[REDACTED]", which the supervisor keeps as it is.
type redactor struct {
	needles []string // rule 1, longest first
	short   []string // rule 2
}

// newRedactor returns nil when there is nothing to redact.
func newRedactor(secrets map[string]string) *redactor {
	r := &redactor{}
	for _, v := range secrets {
		switch {
		case v == "":
		case len(v) < minRedactLen:
			r.short = append(r.short, v)
		default:
			for _, f := range redactionForms(v) {
				if !contains(r.needles, f) {
					r.needles = append(r.needles, f)
				}
			}
		}
	}
	if len(r.needles) == 0 && len(r.short) == 0 {
		return nil
	}
	sort.Slice(r.needles, func(a, b int) bool {
		if len(r.needles[a]) != len(r.needles[b]) {
			return len(r.needles[a]) > len(r.needles[b])
		}
		return r.needles[a] < r.needles[b]
	})
	return r
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// redactionForms are the forms a value is looked for in: as it is,
// JSON-escaped (the value inside JSON text), percent-encoded (in a URL).
func redactionForms(v string) []string {
	forms := []string{v}
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if enc.Encode(v) == nil {
		q := strings.TrimSuffix(buf.String(), "\n")
		forms = append(forms, q[1:len(q)-1])
	}
	var pct strings.Builder
	for i := 0; i < len(v); i++ {
		c := v[i]
		if 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || strings.IndexByte("-._~", c) >= 0 {
			pct.WriteByte(c)
		} else {
			fmt.Fprintf(&pct, "%%%02X", c)
		}
	}
	forms = append(forms, pct.String())
	out := forms[:0]
	for _, f := range forms {
		if len(f) >= minRedactLen && !contains(out, f) {
			out = append(out, f)
		}
	}
	return out
}

// str redacts one string.
func (r *redactor) str(s string) string {
	if r == nil || s == "" {
		return s
	}
	for _, v := range r.short {
		if s == v {
			return redactedMarker
		}
	}
	out := r.replace(s)
	if r.leaks(out) {
		for _, fallback := range []string{redactedMarker, "***"} {
			if !r.leaks(fallback) {
				return fallback
			}
		}
		return ""
	}
	return out
}

func (r *redactor) replace(s string) string {
	if len(r.needles) == 0 {
		return s
	}
	var b strings.Builder
	last := 0
	for i := 0; i < len(s); {
		n := r.matchAt(s, i)
		if n == 0 {
			i++
			continue
		}
		if b.Len() == 0 {
			b.Grow(len(s))
		}
		b.WriteString(s[last:i])
		b.WriteString(redactedMarker)
		i += n
		last = i
	}
	if last == 0 {
		return s
	}
	b.WriteString(s[last:])
	return b.String()
}

// matchAt returns the length of the longest value found at s[i:], or 0.
func (r *redactor) matchAt(s string, i int) int {
	for _, n := range r.needles {
		if strings.HasPrefix(s[i:], n) {
			return len(n)
		}
	}
	return 0
}

func (r *redactor) leaks(s string) bool {
	for _, n := range r.needles {
		if strings.Contains(s, n) {
			return true
		}
	}
	return false
}

// value redacts every string inside a decoded JSON value, object keys
// included. A number whose text contains a value becomes a redacted string;
// two keys that become equal are kept apart with a "#2", "#3", ... suffix.
func (r *redactor) value(v any) any {
	if r == nil {
		return v
	}
	switch v := v.(type) {
	case string:
		return r.str(v)
	case json.Number:
		if red := r.str(v.String()); red != v.String() {
			return red
		}
		return v
	case []any:
		for i := range v {
			v[i] = r.value(v[i])
		}
		return v
	case map[string]any:
		keys := make([]string, 0, len(v))
		for k := range v {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		out := make(map[string]any, len(v))
		for _, k := range keys {
			key := r.str(k)
			for i := 2; ; i++ {
				if _, taken := out[key]; !taken {
					break
				}
				key = r.str(fmt.Sprintf("%s#%d", r.str(k), i))
			}
			out[key] = r.value(v[k])
		}
		return out
	}
	return v
}

// redactingHandler redacts a job's secret values from the message and the
// attributes of every record (the per-job logger's last line of defence: the
// supervisor redacts the stderr tail it keeps, not what a log shipper reads).
type redactingHandler struct {
	h slog.Handler
	r *redactor
}

func (h *redactingHandler) Enabled(ctx context.Context, l slog.Level) bool {
	return h.h.Enabled(ctx, l)
}

func (h *redactingHandler) Handle(ctx context.Context, rec slog.Record) error {
	out := slog.NewRecord(rec.Time, rec.Level, h.r.str(rec.Message), rec.PC)
	rec.Attrs(func(a slog.Attr) bool {
		out.AddAttrs(h.attr(a))
		return true
	})
	return h.h.Handle(ctx, out)
}

func (h *redactingHandler) WithAttrs(attrs []slog.Attr) slog.Handler {
	red := make([]slog.Attr, len(attrs))
	for i, a := range attrs {
		red[i] = h.attr(a)
	}
	return &redactingHandler{h: h.h.WithAttrs(red), r: h.r}
}

func (h *redactingHandler) WithGroup(name string) slog.Handler {
	return &redactingHandler{h: h.h.WithGroup(h.r.str(name)), r: h.r}
}

func (h *redactingHandler) attr(a slog.Attr) slog.Attr {
	a.Key = h.r.str(a.Key)
	v := a.Value.Resolve()
	switch v.Kind() {
	case slog.KindString:
		a.Value = slog.StringValue(h.r.str(v.String()))
	case slog.KindGroup:
		group := v.Group()
		red := make([]slog.Attr, len(group))
		for i, g := range group {
			red[i] = h.attr(g)
		}
		a.Value = slog.GroupValue(red...)
	case slog.KindAny:
		// An error, a struct, ...: as text, when that text holds a secret.
		text := fmt.Sprint(v.Any())
		if red := h.r.str(text); red != text {
			a.Value = slog.StringValue(red)
		} else {
			a.Value = v
		}
	default:
		a.Value = v
	}
	return a
}
