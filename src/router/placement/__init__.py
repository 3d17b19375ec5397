"""What each replica should hold and how soon it could answer: the prefix index and the TTFT model.

The `ttft` policy asks two things of every routable replica, and this module answers both.

**How much of this prompt does it hold?** One `PrefixIndex` (router.prefix, compiled) keeps per
replica an LRU of the blocks (router.prompt) the router sent there, as many as the replica's KV
cache holds: the engine's own figure (vLLM `vllm:cache_config_info` block_size x num_gpu_blocks,
SGLang `max_total_num_tokens`), else `kv_capacity_tokens`, else `DEFAULT_KV_TOKENS`. Tokens become
blocks at the bytes-per-token ratio the replicas' `usage.prompt_tokens` shows (learnt, 4 at
first). After every answer the engine's `cached_tokens` says how right the guess was:
- it held less than predicted: the blocks past what it held are dropped, and the replica's LRU
  shrinks by the share it over-predicted (its KV also holds what others sent, or decode blocks);
- it held next to nothing of a long predicted prefix twice running: it restarted or cleared its
  cache, and its LRU is emptied;
- it held all it was said to: the LRU grows back towards the engine's capacity.

**When would its first token come?** A replica prefills what it is given in order, so the router
keeps, per replica, the time its prefill queue drains (`busy_until`): a request of u uncached
tokens sent at t starts at max(t, busy_until) and moves it to that + u x seconds per token. The
seconds per token are learnt from every streamed answer that had the replica to itself (with
others there its first token also waited for their decode steps and for room in its KV cache):
its measured TTFT, less the decode share, over the tokens it waited for and computed (at least
SPEED_MIN_TOKENS: below that a step's fixed cost dominates), starting at `prefill_tokens_per_s`.
A replica's speed is the median of its last SPEED_WINDOW samples, weighed against its peers'
median (the median of the medians of the replicas serving the same models, else the whole
fleet's) as if that were SPEED_PRIOR samples more: replicas of one model prefill alike, and a few
odd samples must not make one look slow (it would get a fraction of the traffic for as long as it
kept them: at 5x the Mooncake traces, identical emulated replicas were learnt at 5,700 to 17,100
tokens/s, and got 11 to 89 requests each), while another model's replicas may be several times
slower or faster. A replica not yet measured takes its peers' median (else the first one measured
fast would look like the only fast one, and draw everything). So

    cost(replica) = max(0, busy_until - now, kv_wait)             wait for what was sent there (or
                                                                  for room in its KV cache)
                  + other_waiting x mean uncached x s_per_token   queued by others (probed)
                  + running x ttft_decode_s                       its decode steps slow prefill
                  + (prompt tokens - cached tokens) x s_per_token x (1 + ttft_interference x running)
                                                                  this request's own prefill, and
                                                                  the delay it causes the running
                  + ttft_spread_tokens x s_per_token x excess x uncached / prompt   what new context commits
                  + evicted x block tokens x s_per_token          what it pushes out of the conversations
                                                                  likely back soon (events only)

kv_wait: an engine admits a request only once its blocks fit. The router counts the tokens it has
in flight on each replica (prompts, and the mean reply length); past its KV capacity C, a request
of r tokens waits (in flight + r - C) / C x the fleet's mean reply time (a cache's worth of
requests finishes every reply). Without it a replica with an empty prefill queue but a full
cache looked free, and an overloaded fleet's first tokens waited where the model saw no queue.

busy_until is the router's model of what it sent; the engines' first tokens correct it. A request
remembers when its first token was due (`Placed.due`); a streamed answer whose first token came
`lag` seconds later (less the corrections that replica's queue had since: `Held.shift`) moves
that replica's busy_until by `ttft_queue_gain` x lag while others are still in flight there
(`_lagged`), and an early one back (never before now).

The last term is not this request's time to first token but the turns a conversation placed there
will bring: excess = (recent - mean recent)+ / (mean recent + 4), from the requests
sent to each replica, decaying over SPREAD_WINDOW_S, and scaled by the share of the prompt the
replica would compute (a replica that holds nearly all of it is continuing a conversation, not
taking a new one). Without it an idle fleet sends every new conversation to the replica holding
their shared system prompt: right for one first token, wrong for the load (and the cache room)
of every turn after it. A chat with no assistant turn yet (`Prompt.opening`) is a new conversation
however much of it a replica holds (a coding agent's 12k-token tool prompt is most of its first
turn, and its own context grows past it within a few tool calls): its spread is charged whole,
not by the share computed, and in at least the tokens of its messages before the last that the
replica holds (its shared system or tool prompt), so what that prefix saves it there draws it no
further than the replica's excess allows. Nor is such a holder its home (router.policy.ttft: a
new conversation's home holds some of its last message; the stay margin had kept the agents'
sessions there). On the agents workload the holders of the two shared tool prompts had drawn
every session (load CV 1.53; 1.20 with the spread charged whole; 0.86-1.02 with no home).
A document in its last message is its own work, not a shared prefix: it is not counted (counting
it cost long-document QA a point of hit rate). A keyed session's own replica never pays it.

The eviction term, where the replica's engine publishes KV-cache events: a request allocating
more blocks there than are empty evicts its oldest free blocks, and those may be a conversation
that ended a turn there seconds ago and is about to come back (router.kvevents.truth.Truth.evicts:
its blocks evicted, weighed by how likely it comes back before the replica's other traffic would
have evicted them anyway). They would be computed again on its return, at that replica's speed.
So a long new context goes where it destroys least (empty blocks, or blocks nobody is coming back
for), and it is no part of the predicted time to first token (`Candidate.ttft_s`).

`price` hands all of it to the compiled core (`PrefixIndex.price`: one loop over raw arrays kept
by fleet position), which also applies the gate and finds the cheapest and its near-ties;
router.policy.ttft breaks ties and applies the stay margin.

Worked example, 2 s of work queued on replica A holding a 10,000-token document, replica B empty,
both at 20,000 tokens/s, nothing in flight, a 10,400-token question on that document: A costs
2 + 400 / 20,000 = 2.02 s, B 10,400 / 20,000 = 0.52 s, under half of A's (the stay margin): B
wins, and now holds the document too (a hot prefix gained a second holder because its first was
the bottleneck). With 0.2 s queued on A instead, A costs 0.22 s and keeps it.

The parts:

- `pricing`: `Placement`, the records and rows of every replica, `price`, and a request's life
  (`sent`, `failed`, `released`, `answered`);
- `priced`: a price as a value (`Priced`: every candidate's row, `Candidate`);
- `learnt`: what the answers teach (bytes per token, the mean request, prefill speeds, the queue's
  lag, the index's corrections, accuracy);
- `rows`: the arrays by fleet position the compiled core reads; `kv_room`: room in the KV caches;
  `events`: what the engines' events say of a prompt; `records`: `Held`, `Placed`, `Answer` and the rest.
"""

from router.placement.priced import Candidate, Priced
from router.placement.pricing import Placement
from router.placement.records import Accuracy, Answer, Held, Placed, Prediction

__all__ = ["Accuracy", "Answer", "Candidate", "Held", "Placed", "Placement", "Prediction", "Priced"]
