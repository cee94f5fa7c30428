"""The torch_dist transport's tuning constants, in one place: what each bounds, its unit, and why
its value.

They decide routes, pipeline depths and block sizes, which every rank must choose alike (from
sizes every rank agreed on), so they are module constants read by every rank, not per-rank
options. None of them changes a result: every route and depth sums the same rows in the same
order (bit-identical outputs); they only move time between latency and bytes.
"""

# -- The two-stage pipeline's depth (route.choose_route) -------------------------------------------
# Deepest automatic pipeline, in chunks per dispatch: enough to hide stage 2 (intra-node) behind
# stage 1 (inter-node), and few collectives (each chunk is one per stage). Also the number of
# token sub-ranges a fresh dispatch's counts are taken over in worlds that can take the two stages
# (a depth is a grouping of sub-ranges).
NUM_CHUNKS = 4
# Automatic depth, in bytes: one chunk per this many stage-1 payload bytes of the largest sender
# (at most NUM_CHUNKS): a chunk large enough that its collective's latency stays small against its
# transfer.
CHUNK_BYTES = 16 << 20

# -- The route on NCCL: GPU links (route.two_stages_pay) -------------------------------------------
# Flat when no rank sends more payload bytes than this (the sizes where a second collective's
# latency costs more than the de-duplicated bytes save: a few MB at 50 GB/s and tens of
# microseconds per collective) ...
FLAT_BYTES = 4 << 20
# ... or when the two stages would cut the rows crossing nodes by less than this fraction (routing
# that reaches few ranks per node, e.g. top-2: the second stage's latency and forwarding copy then
# cost more than they save). A fraction of the flat route's cross-node rows.
MIN_DEDUP = 0.25

# -- The route on gloo: measured links (route.measure_links, route.two_stages_pay) -----------------
# On gloo, where links range from a loopback to a shaped or real network, the links are measured
# instead, the first time a call's largest flat payload exceeds LINK_PROBE_BYTES (below it a second
# collective never pays) or the fused blocks' padding exceeds FUSED_PADDING (below): an exchange
# of a few bytes and of LINK_PROBE_BYTES per peer on each of the transport's groups (all ranks,
# inter-node, intra-node). Bytes per peer; megabytes: smaller exchanges fit a shaped link's burst
# or a switch's buffers and see the link faster than it is.
LINK_PROBE_BYTES = 2 << 20
# Each probe is timed this many times after one untimed exchange; a rank keeps the median (a
# descheduled rank or a shaped link's refilled burst moves one sample, not the figure).
LINK_PROBE_SAMPLES = 5
# The two stages are taken on gloo where the links say they take at most this fraction of the flat
# route's time: they do host work the links do not see (a second route, a reorder), and a choice
# on a near tie flips with the measurement's noise between runs.
TWO_STAGE_GAIN = 0.85

# -- Rows in the blocks of the counts and checks: one collective per call (blocks.Blocks.resize) --
# The flat route: a dispatch's rows travel in its counts' blocks, a combine's or cached dispatch's
# in its argument check's, where no rank sends a peer more than the block holds; blocks hold the
# previous dispatch's largest flat payload to one peer (or more, below), if at most this many
# bytes (one collective instead of two: at these sizes the round trip costs more than the padding
# up to the block size). Bytes per peer.
FUSED_BYTES = 1 << 20
# ... and the padding adds at most a quarter to the bytes (a ratio: the padded blocks' bytes over
# the rows' own); or, on gloo, the measured links move the padding in less time than the
# collective saved takes (route.padding_pays).
FUSED_PADDING = 1.25
# ... the blocks hold the largest pair of this many recent dispatches where that padding pays too
# (a step's MoE layers: each routes differently, and the next one's rows then fit more often).
RECENT_DISPATCHES = 8
