"""kvroute's default policy: least estimated time-to-first-token, counting what a miss costs
everyone else."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import ClassVar

from kvroute.core.load import PrefillMode, WorkerLoad
from kvroute.core.policies.base import (
    Ranking,
    RouteQuery,
    Scored,
    fetch_plan,
    rank_by_cost,
    rendezvous_order,
)

try:  # the optional C build of the same ranking (setup.py); absent, the Python path runs
    from kvroute.core._kvcost import rank as _native_rank
except ImportError:  # pragma: no cover - depends on the build
    _native_rank = None

NATIVE_AVAILABLE = _native_rank is not None


def work(n: int, c: int, attn: float) -> float:
    """The prefill cost of ``n`` new tokens after ``c`` cached ones, in token units: each
    costs 1 plus ``attn`` per token of context it attends to (``work`` in the formula below)."""
    return n * (1.0 + attn * (c + n / 2))


@dataclass(slots=True)
class KvrouteCost:
    """Send the request where it costs the cluster least, in prefill-token units.

    Formula, for each candidate worker ``w``::

        cost_w = beta * work(P - c_w, c_w)                  # the prefill this request adds
               + pending_w                                   # prefill queued ahead on w
               + decode_weight * max(running_w, inflight_w)  # the decode batch it joins
               + kv * kv_usage_w * capacity_tokens_w         # KV held by running sequences
               + batch_weight * b_w * work(P - c_w, c_w)     # the queued first tokens it delays
               + affinity_weight * max(0, q - 1) * (P - c*) * r_w   # keep families apart
               + arrival_weight * room * lambda_w * s * work(P - c_w, c_w)^2 / 2
                                                             # the arrivals it delays
               + churn(F) * pi_w              if c* < hold_min * P   # what it delays, evicts

        work(n, c) = n * (1 + attn * (c + n / 2))            # n new tokens after c cached
        q          = mean_w(queued_w)                        # the cluster's mean queue
        beta       = miss_weight * (1 + stickiness * q)
        kv         = kv_weight / (1 + kv_decay * q) * ramp(F)
        F          = mean_w(cache_fill_w)                    # how full the caches are
        ramp(F)    = 0 up to kv_fill_from, 1 from kv_fill_full, linear between
        r_w        = w's rank in the rendezvous order of the request's family / (workers - 1)
        c*         = max_w c_w                               # the longest prefix cached
        b_w        = queued_w  if pending_w + P - c_w <= budget_w  else 0
        budget_w   = w's max_batched_tokens (the engine's prefill budget), else batch_tokens
                     (where w's engine chunks prefills: queued_w x work(min(P - c_w,
                     budget_w - pending_w, cap_w), c_w) while that is > 0, the first
                     chunk's share; w's prefill_mode says, else chunked_prefill)
        cap_w      = the most tokens of one prefill w's engine computes per iteration
                     (max_prefill_chunk: vLLM's --long-prefill-token-threshold; none: inf)
        lambda_w   = requests per second sent to w lately (its arrival_rate)
        room       = 1 - F                                   # the caches' free share
        s          = prefill_s_per_token                     # seconds per unit of work
        pi_w       = prompt tokens per second w prefilled lately (uncached; its
                     prefill_rate): what comes back to it, how fast its cache turns over
        churn(F)   = churn_s + (churn_full_s - churn_s) * ramp(F)   # 0.3 s .. 3 s

    then the hold rule, before the affinity and arrival terms: with ``h`` the worker holding
    the longest cached prefix ``c_h`` (the cheaper one if several) and ``m`` the cheapest
    worker::

        if c_h >= hold_min * P  and  c_m < c_h  and  h has batch headroom
           and (join_hold and joins_h  or  (backlog_h - backlog_m) * demand
                              < hold * beta * (work(P - c_m, c_m) - work(P - c_h, c_h))):
            h goes first (its reported cost is just below cost_m)

        joins_w   = w's engine chunks prefills and caps each chunk at cap_w
                    and  ahead_w = (waiting_w + 1) x cap_w < budget_w
                    (the request joins w's next iteration whatever is queued there)

        backlog_w = pending_w + attn * context_w   # w's queued prefill in work units
                    (x ahead_w / pending_w where w joins and ahead_w < pending_w: the
                    chunks the request waits for)
        context_w = what w's pending tokens attend to (pending_prefill_context)
        waiting_w = requests sent to w not running yet (WorkerLoad.waiting)

        demand = 1                              with replicate (the default): and where
                                                1 + demand_horizon_s * d would have moved
                                                the request to m, ``replica`` names m, and
                                                the router copies h's prefix there
        demand = 1 + demand_horizon_s * d       with replicate 0: the request moves to m

    and with ``tail_hold`` > 0 (the tail rule, off by default), unless the request's first
    token would come in the tail there and not on m::

        first_m <= tail_hold * T < first_h      (then the hold rule keeps nothing)

        first_w = backlog_w + work(P - c_w, c_w)   # when w would prefill its last token
        T       = the 99th percentile of work(P - c*, c*) over the last 2000 requests:
                  the least prefill the traffic needs at its tail (RouteQuery.tail_work,
                  kept by the router and the replay: ``PrefillTail``; inf before 200)

    where ``d`` is the prefix's demand: requests per second lately whose longest cached
    prefix ended at the same block (``RouteQuery.prefix_rate``).

    ``P`` is the prompt length, ``c_w`` the tokens of its longest prefix cached on ``w``
    (matched blocks x block size), the rest comes from the load view (``inflight_w``, this
    router's own outstanding requests, covers the time before a heartbeat reports them).
    Lowest cost wins; equal costs go by a rendezvous hash of the request's affinity (session
    or first block), so a cold burst sharing a prefix lands together.

    Why this shape:

    * A cache hit saves the prefill of the cached tokens, and the attention over a cached
      context is saved too (``attn`` per context token), so a long shared prefix is worth
      more than its length.
    * A miss costs more than the request's own wait: its extra prefill delays every request
      that queues behind it. That externality grows with queueing, hence ``beta`` rises with
      the cluster's mean queue: under light load kvroute balances, under heavy load it keeps
      prefixes where they are cached instead of thrashing every cache (which is how
      load-chasing policies collapse).
    * A worker whose KV blocks are held by running sequences admits new work only as those
      finish, whatever its queue says: ``kv_usage`` predicts that wait. Once queues form,
      every worker's KV is full and the term only pushes requests off their caches, so it
      fades as the mean queue grows. And it matters only once blocks are scarce: a worker
      whose cache is full makes room for a new sequence's KV by evicting prefixes its
      sessions come back for (without the term, the Mooncake trace, whose caches stay
      80-100% full, lost up to 8.5 points of hit ratio and its mean TTFT rose up to 2.4x).
      While the caches have room, KV evicts nothing and delays no admission, and the term
      only places new sessions by the context their workers hold rather than by the
      sessions they run, whose next calls are the prefill to come: on agent traffic, whose
      caches stay a third full, that cost about 1% of mean TTFT against Preble's exploit
      rule (least queued, then fewest running). So the term grows in with the caches' mean
      fill (``ramp``), as the arrival term fades out with it.
    * Under overload, caches thrash unless each prefix family keeps to a few workers (what
      consistent hashing gets right, and load-chasing policies lose). Once the mean queue
      passes one request, each worker is charged in proportion to how far it lies from the
      front of the rendezvous order of the request's family, times the tokens no worker
      caches yet (``P - c*``), so families settle on their own workers while load still
      decides among near equals. The family is the session, else the first block no worker
      caches yet (``RouteQuery.family``): keyed by the first block, every request under a
      system prompt that all workers hold fell into one family. Only the uncached part is
      placed anew: a request whose prefix is cached somewhere is placed by the miss and
      hold terms. The earlier form (0.5 x P by the first block) pulled sessions that share
      a system prompt to the same few workers, and was too weak on the Mooncake trace at
      80-95% load: this one cut kvroute's mean TTFT there to 0.48x and 0.80x (6 and 5
      points more hit ratio), and on agent traffic at 80-95% to 0.89x and 0.78x.
    * An engine admits its queue in iterations of up to ``max_batched_tokens`` prompt
      tokens, and every request admitted in an iteration gets its first token when the
      iteration's prefill ends. So a long prefill sent to a worker whose queue fits in one
      iteration with it delays each of those queued requests by its own prefill: a short
      chat turn queued behind a new 8k-token prompt waits 0.6 s instead of 0.05 s. The batch
      term charges that delay (``b_w`` requests times this request's prefill there). A queue
      longer than one iteration is admitted ahead of the request and is not delayed, so the
      term is off there: charged on every queue, it pushed requests off their caches under
      overload (Mooncake trace at 80%: 10.2 s mean TTFT instead of 6.9 s). (An engine that
      chunks prefills, as vLLM V1 does, still puts the first ``budget - pending`` tokens of
      such a prompt in the queue's iteration, and the term charges that chunk there. Each
      worker's agent reports which its engine does (``WorkerLoad.prefill_mode``); the
      figures here were measured without the simulator's ``--chunked-prefill``, so the
      all-or-nothing gate is what was tuned.)
      With it, mean TTFT fell 5-6% on fork traffic at 50-80% load and 5% on agent at 80%,
      and p99 1-3% on chat, at the same hit ratios (seed 1; on seed 2, agent at 65-80% 2-8%
      lower mean); it rose 2% on agent at 65%, and on the Mooncake trace at 80% by 6% (p99
      23%), still half llm-d's.
    * The balance terms (``decode_weight``, ``kv``) move a request off its cache whenever a
      worker is cheaper by a hair, and each such move redoes the prefill of the prefix it
      leaves and costs token hits (0.3-0.8 points on chat and agent traffic, where a
      session's history lives on one worker). But a request's first token waits only for
      the prefill queued ahead of it (and for a batch slot), not for the decode batch or
      the KV it joins. So the hold rule keeps a request whose cached prefix is most of its
      prompt (Preble's exploit test) on that prefix unless another worker's queued prefill
      is shorter by more than ``hold`` x the prefill it would redo (in cost units, so
      scaled by ``beta``), or the holder has no free batch slot: balance alone never moves
      a session, a queue that would delay it by several times the redo does. Judging the
      move on the whole cost instead (balance terms included, ``hold`` 0.75) moved more
      sessions, for 0.1-0.4 points less hit ratio on chat, agent and rag traffic and no
      better mean TTFT (its p99 was 1-5% lower on chat and rag).
    * The hold rule weighs a backlog in work units, as the redo it is compared with: the
      pending tokens plus ``attn`` times the context they attend to (``backlog_w``; the
      router counts ``WorkerLoad.pending_prefill_context`` for what it sends). Counted in
      tokens, a holder prefilling a 191k-token prompt (68 s) looked like 191k units
      against a 43k-token redo's 74k, and the Mooncake trace's sessions waited out such
      prefills for turns of a few hundred new tokens: at 50% load its 39 slowest requests
      (its p99) waited 6-12 s each on average, Mooncake-local's 0.3-0.5 s. Against the
      backlog in tokens (``bench/policy_jitter.py``, open loop, 16 workers, jitters 0.98 /
      1 / 1.02): the Mooncake trace's mean / p99 TTFT 4.5% / 4.0% lower at 50% load (9.42 s
      against Mooncake-local's 9.26 s, from 9.82 s), 3.3% / 0.4% at 65% and 2.6% / 4.3% at
      95%, hit ratio level, -0.5 and +1.0 points; at 80%, where single replays swing by 2x,
      15% lower over ten nudged jitters and 26% higher over ten plain ones. Chat, rag,
      agent and fork traffic move by 1% or less (agent seed 2 at 80%: p99 4% higher); in
      a closed loop agent sessions, whose histories reach 30k tokens, leave a busy holder
      a little sooner: hit ratio 0.001-0.008 points lower, mean TTFT level.
    * An engine that caps each prefill's chunk (vLLM's ``--long-prefill-token-threshold``,
      reported as ``max_prefill_chunk``) lets a request queued behind a long prefill into
      the next iteration beside that prefill's chunk: it waits for the chunks ahead of it,
      one per request waiting there and the running one's, not for the whole prompt. Where
      those chunks leave room in the iteration, no move can save the request more than
      them, and a move redoes its prefix: so the hold rule keeps it on such a holder
      (``join_hold``), counts only their share of the backlog on the worker it would move
      to, and the batch term charges a queue only the capped chunk (a policy that ignored
      the caps, ``chunk_caps`` 0, moved sessions off holders they could have joined, and
      redid their histories). With an 8192-token budget and a 2048-token cap (three
      jitters), against ``chunk_caps`` 0 over the 52 open-loop cells (cold): all three won
      in 44 cells instead of 43; the Mooncake trace's hit ratio 1.6-3.3 points higher at
      50-80% load (from 1.5-1.9 points below llm-d's to 0.1 above at 50%, 0.3 below at
      65% and 1.7 above at 80%), and its mean TTFT at 80% 18% below llm-d's where it was
      0.7% above. Closed loop, chat and agent from a warm start, at equal load: 12 of 24
      cells won on all three (chat 10 of 12), none with ``join_hold`` 0, whose hit ratio
      was 0.00-0.02 points below llm-d's in all 24 (README, "A cap on each prefill's
      chunk").
    * A hot prefix is worth a second copy sooner than a session is. Every request that
      wants it over the next ``demand_horizon_s`` seconds (``d`` per second) queues on its
      holder's backlog, so the backlog counts ``1 + demand_horizon_s * d`` times; a
      session's history ends at a new block each turn, so its ``d`` is ~0 and the rule is
      unchanged for it. This matters once the router coalesces requests on prefixes still
      in flight: before, a hot document's second request, arriving during its first
      prefill, computed it elsewhere and so made a copy by accident; coalesced, it waited,
      and the document kept one copy (rag traffic at 95% load: documents read 10 times or
      more had 1.19 copies on average, then 1.0; their requests' mean TTFT rose from 70 to
      84 ms). With ``demand_horizon_s`` 10 s, as shipped (router coalescing on, replies
      cached; seed 1, 16 workers, jitter-averaged, against ``demand_horizon_s`` 0): rag's
      mean TTFT 2.1-5.0% lower at 50-95% load for 0.09-0.19 points of hit ratio; chat
      within 1%, fork the same; the Mooncake trace 3.2% lower at 65% and 1.9% higher at
      50%; agent within 1% at 50-80% but 8.8% higher at 95% (seed 2: 4.1%; seed 3: 2.5%
      lower), where copies of agents' system prompts cost more than they save (3 s: 4.9%,
      with about half of rag's gain). Against the peers (with only prompts cached), cells
      won on all three rose from 8 to 10 of 16 on seed 2 and from 11 to 12 on seed 3 (13 of
      20 on seed 1 either way). Without
      coalescing (``--predict-ttl-ms 0``) the policy table's counts stay the same, but the
      Mooncake trace's p99 at 80% rises 30% (44.9 s against 34.6 s; llm-d's is 91.9 s) and
      rag's hit ratio falls 0.1-0.2 points: there the accidental copies still happen.
      Those copies were made by moving the request that showed the demand, which then
      prefilled the whole prefix again (a miss: the 0.09-0.19 points). With ``replicate``
      (the default) that request keeps its hit on the holder, and the router makes the copy
      in the background (``kvroute/router/copies.py``: a one-token request of the prefix's
      blocks to the worker the request would have moved to; the replay simulator makes the
      same copy and reports its prefill apart). Against ``replicate`` 0
      (``bench/policy_jitter.py``, seeds 1-3 of each generated workload and the Mooncake
      trace, 16 workers, open and closed loop, cold and ``--warmup 600``): the hit ratio
      rises 0.08-0.22 points on rag traffic, to the infinite cache's within 0.01-0.04, and
      0.06-0.43 on the Mooncake trace, and moves 0.1 points at most elsewhere; mean TTFT
      moves -2.8% to +2.0% (agent, seed 3, 95%, cold: +6.4%) and p99 -8% to +9%: the
      request that stays waits out its holder's backlog instead of redoing the prefix
      elsewhere, which costs rag's tail up to 8% in some cells. Cells won on all three
      against the peers: 31 -> 37 of 52 open loop from a warm start, 36 -> 35 cold; closed
      loop 15 -> 15 and 15 -> 14 of 40.
    * A hot prefix's holders bound where the sessions that start on it can go, and a session
      stays where it starts. A chat trace's three system prompts were held by 5, 4 and 3 of 16
      workers through a whole replay: the copies made while the cluster was cold, and none
      after, since no first turn gained enough by computing a prompt again elsewhere. The most
      used prompt starts 56% of the sessions, so they piled on 5 workers. Which policy made one
      more copy at the start decided chat's mean TTFT for the rest of the replay (routing on the
      router's predictions, which had a first turn wait for the prompt's holder instead of
      computing it on an idle worker, cost 1.8% at 50% load). So the spread rule: while each
      holder of a prefix would get more than ``spread_demand`` of its requests over
      ``demand_horizon_s`` (its demand ``d`` counts the requests whose longest cached prefix
      ends there: the sessions starting on it, not their later turns), the router copies it in
      the background to the cheapest worker without it (``replica``), unless the average worker
      has a request queued or that worker has prefill pending (a copy runs on spare prefill
      only: in an open loop at 95% load, agent traffic's cold burst made copies that cost
      seeds 1 and 2 4.7-5.0% of mean TTFT; with the queue gate 3.9% and 2.8%, with both
      gates 0.1% less than no copies on each, seed 3 level; chat, rag and fork kept their
      gains, rag's 95% 4.0% instead of 5.1%). Against the same policy
      without it (``spread_demand`` 0; seed 1, 16 workers, ten rate jitters each with its
      arrivals moved by up to half their gaps, ``--warmup 600``, closed loop): chat's mean TTFT
      5.2% lower at 50% load (p99 2.6%) and the hit ratio 0.01 points higher; seed 2 1.9% lower;
      rag's (open loop, 80%) 3.7% lower, for 104 copies that prefilled 2.26% of the prompt
      tokens again instead of 6 (0.10%; ``spread_demand`` 4: 41, 1.04%, for most of the gain);
      agent traffic in a closed loop and the Mooncake trace level.
    * A long prefill delays every request that reaches its worker while it runs: an arrival
      waits for the iteration in progress, on average half of it. With ``lambda_w``
      requests per second reaching ``w`` (its ``arrival_rate``: what was sent there
      lately; sessions and agent loops come back to the worker holding their cache), a
      prefill of ``t`` seconds delays them by ``lambda_w * t^2 / 2`` seconds in all, which
      is ``lambda_w * s * work^2 / 2`` in prefill-token units. Quadratic in the uncached
      work, it is nothing for a chat turn (200 tokens at 4 requests/s: ~7 units) and
      decides for a cold 8k-token prompt (~14k units), which goes where fewer requests
      arrive. Neither the queue (what is already waiting) nor the batch term (what will be
      admitted with it) sees these requests. The term fades as the caches fill
      (``room``): once they are full, where a new prefix lands decides what it evicts and
      where its family will follow. Without that gate (weight 1, in an experiment) the
      Mooncake trace, whose caches stay 80-100% full, lost about 3 points of hit ratio at
      50-80% load; with it, weight 1 still cost 1.3 points at 50%.
      Against the same policy without it (``arrival_weight`` 0; seed 1, 16 workers, 7 rate
      jitters): on the Mooncake trace, mean TTFT 10.6%, 17.4% and 3.5% lower at 65%, 80%
      and 95% load (p99 9.0%, 18.6% and 2.9% lower) with 0.4-1.6 points more hit ratio,
      and level at 50% (0.4 points less hit ratio); on chat and rag traffic mean and p99
      up to 2.2% lower at level hit ratios; on agent and fork traffic level within the
      noise (agent: 4.5% lower at 65%, 3% higher at 80%). Weight 1 gained more on agent
      traffic but cost the Mooncake trace 4% of mean TTFT at 50%.
      The rates are counted from when the router started (``ArrivalRate.start``) and
      corrected for it, as is the prefix demand ``d``: a sum that starts at 0 reads only
      ``1 - exp(-t / 30 s)`` of a steady rate after ``t`` seconds, 30 times too low after
      1 s, so through a cold start this term slept. There, on chat traffic, a new session's
      long first turn went to the worker holding a hot system prompt, the turns that reached
      it meanwhile were admitted with it and waited out its prefill: on ``kvroute gen chat
      --seed 2`` at 80% load, 15 of the 60 slowest requests came in the first second and
      waited 0.2-0.65 s each (p99 0.659 s, Mooncake-local's 0.640 s); corrected, 1 does, and
      28 of the 30 slowest are bound by their own prefill (p99 0.598 s). Over the 52
      open-loop cells (``bench/policy_jitter.py``, three jitters, against the uncorrected
      rates) kvroute's mean TTFT margin over the best peer widened by 1.1 points cold and
      0.4 warm, chat's and agent's p99 margins by 0.9 and 3.7 points cold, and the closed loop
      gained most (README, "Arrival rates counted from the start"); rag's p99 margin from a
      cold start narrowed by 1.3 points.
    * What a worker prefilled lately comes back to it: a session's next turn, a document's
      next read, held there by their cached prefix (the hold rule). A new long prompt sent
      there is prefilled ahead of them, and they wait it out: on rag seed 3 at 95% load from
      a cold start, a new 9.6k-token prompt went to the worker that had just prefilled a
      10k-token document, chosen for its lower arrival rate, and two reads of that document
      77 ms later waited 1 s each (p99 5.9% above Mooncake-local's). And once the caches are
      full, each token a worker prefills evicts a cached one, so a worker that prefills more
      turns its cache over sooner and its sessions come back to find their history gone.
      Either way the queue a new prompt sees is a poor guide to what will come. The churn
      term charges a prompt no worker caches most of ``churn_s`` (0.3) seconds of each
      worker's recent prefill (``prefill_rate``: the uncached tokens sent there, over the
      arrival window, the larger of the router's count and the agent's) while the caches
      have room, ``churn_full_s`` (3) once they are full, linear between (``ramp``). Against
      the same policy without it (the 52 open-loop cells, three jitters, against the same
      peers' runs): all three won in 47 cells from a cold start instead of 40 (p99 lost in 5
      instead of 12; chat's mean p99 margin over the best peer 1.2% instead of 0.5%, rag's
      0.7% below it instead of 0.9% above) and 43 from a warm start as before (p99 lost in 1
      instead of 5, the hit ratio in 8 instead of 7, by up to 0.04 points); hit ratio
      margins within 0.02 points of before. ``churn_s`` 1 won as many open-loop cells but in
      a closed loop from a cold start cost agent traffic up to 4.4% of mean TTFT, 13% of p99
      and 0.07 points of hit ratio, and chat up to 0.10 points; 0.3 moves those cells by
      about 1% of mean TTFT and 0.01-0.05 points either way. On the Mooncake trace, whose
      caches run 85-99% full, the full-cache weight alone (``churn_s`` 0), from a warm
      start: the hit ratio 0.8 points higher at 50% and 65% load (57.2% and 56.6%) and mean
      TTFT 3.8% and 6.5% lower (p99 0.8% and 7.2% lower); at 80% 0.3 points higher and mean
      1.1% lower but p99 3.8% higher, and at 95% 0.6 points lower and mean 3.3% higher
      (still 20% below the best peer's); a full-cache weight of 1 gained less at 50-65% and
      lost nothing at 80-95%, but in a closed loop at 50% (ten jitters) its p99 was 0.3%
      above Mooncake-local's where 3's was 0.8% below; 10 lost more at 80%. With vLLM V1's
      chunked prefills (five jitters, warm): 0.8 points higher at 50% and 65%, and 2.8 at
      80% (50.8%, level with llm-d's where it was 2.8 below; mean TTFT 2.59 s against 4.23
      s). Faded as queues grow (as the KV term), the term gave back 95%'s loss and lost more
      at 50-80%.
    * The p99 of time-to-first-token is made of the longest prompts, whose own prefill puts
      them there, and of requests that waited: on chat and rag traffic from a cold start,
      kvroute's p99 was lost to Mooncake-local's by 0.5-5.9% in 12 of 52 open-loop cells,
      and several of the 30 slowest requests were turns the hold rule kept behind a new
      session's long first prefill on their holder (a 6k-token prompt with 5952 tokens
      cached waited 0.6 s; Mooncake-local, which moves it, gave it its first token in
      0.05 s). The tail rule (``tail_hold`` > 0) lets such a request go when its first
      token on the holder would come later than the traffic's tail ``T`` (the 99th
      percentile of the least prefill of the last 2000 requests: what the longest prompts
      cost anyway) and on the cheapest worker would not. It trades hits for p99, so it is
      off by default. ``kvroute:tail_hold=1`` against the default (``bench/policy_jitter.py``,
      three jitters, 16 workers, the 52 open-loop cells against the same peers' runs):
      from a cold start all three won in 43 cells instead of 40 (p99 lost in 9 instead of
      12; chat's p99 margin over the best peer 1.1% instead of 0.5%, rag's 1.2% below it
      instead of 0.9% above); from a warm start in 38 instead of 43: p99 lost in 1 instead
      of 5, but the hit ratio in 12 instead of 7, by up to 0.20 points, 11 of them on rag
      traffic, where every policy is within a few hundredths of a point of the others and
      each move redoes a document (0.07% of the tokens on rag seed 1 at 80%). With
      ``tail_hold`` 1.15 or 1.5, or ``hold`` 1000 beside it, the counts stay within
      77-83 of 104 either way (the default: 83).

    Parameters (tuned with ``bench/policy_jitter.py`` on the Mooncake trace and the four
    generated workloads, 16 workers, 50-95% load; see README):
        miss_weight: weight of this request's prefill against queued work (default 2.0).
        stickiness: growth of ``beta`` per request queued on the average worker (1.0).
        decode_weight: prefill tokens one running sequence is worth (32).
        kv_weight: fraction of a full worker's KV tokens charged at 100% usage (0.1).
        kv_decay: how fast the KV term fades per request queued on the average worker (1.0).
        kv_fill_from, kv_fill_full: the caches' mean fill where the KV term starts (0.4) and
            where it reaches full strength (0.8); both 0: always on (the term before
            it was gated).
        affinity_weight: uncached prompt tokens charged per queued request (past the
            first) for the last worker in the rendezvous order (3.0).
        attn: attention cost per context token relative to a token's linear cost:
            2.8e-9 s / 8.6e-5 s = 3.3e-5 for Llama-3.1-8B on an A100
            (``core/policies/cost_model.py``).
        hold: how many times the redone prefill (in cost units, so scaled by ``beta``) a
            worker's queued prefill must be shorter by than the holder's to take a request
            off its longest prefix (3.0; 0 turns the rule off).
        hold_min: the rule applies when the longest prefix covers at least this fraction
            of the prompt (0.5).
        batch_weight: weight of the delay this request's prefill adds to each request
            queued with it within one iteration (1.5).
        batch_tokens: the engines' prefill budget per iteration where a worker does not
            report one (8192; vLLM V1 defaults its API server's ``max_num_batched_tokens``
            to 8192 on large GPUs and 2048 on smaller ones: give agents
            ``--max-batched-tokens``).
        arrival_weight: weight of the delay a prefill imposes on the requests arriving
            meanwhile (0.5; 0 turns the term off).
        churn_s: seconds of a worker's recent prefill (``prefill_rate``, tokens per
            second) charged to a prompt no worker caches most of while the caches have room
            (0.3), and churn_full_s once they are full (3.0; linear between, by ``ramp``;
            both 0: off).
        prefill_s_per_token: seconds of prefill per unit of work, to turn that delay into
            work units: 8.6e-5 s for Llama-3.1-8B on an A100, like ``attn`` a property of
            the model and GPU (``core/policies/cost_model.py``).
        demand_horizon_s: how long a hot prefix's demand is counted against its holder's
            backlog in the hold rule (10 s; 0: demand ignored).
        replicate: 1 (the default): a hot prefix's second copy is made in the background
            while the request stays on its holder (``replica``); 0: the request moves to
            make it.
        spread_demand: with ``replicate``, a prefix gets one more holder (a background copy
            to the cheapest worker without it) while each holder would get more than this
            many of its requests over ``demand_horizon_s``, the average worker has no
            request queued and the copy's worker no prefill pending (2.0; 0: off).
        tail_hold: the hold rule lets a request go when its first token on the holder
            would come later than this many times the traffic's tail ``T`` and on the
            cheapest worker would not (0, the default: off; 1 puts p99 before hits, see
            the tail rule above).
        chunked_prefill: how the batch term treats a worker whose agent does not report
            its engine's ``prefill_mode`` (older agents; every current agent and the replay
            simulator report it, and a report always wins). 1: as an engine that chunks
            long prefills (vLLM V1 does): a prompt's first ``budget - pending`` tokens
            join the queue's iteration whatever its length, and the term charges that
            chunk; 0 (the default): as one that admits a prompt whole or not at all (the
            ``sim`` and ``tiny`` engines, the replay without ``--chunked-prefill``).
            Charging the chunk where engines chunk was measured on the 52 open-loop cells
            replayed with chunked prefills (8192-token budget, cold, three jitters): 44
            won on all three against 43 with the whole-prompt gate; rag seed 3's p99 at
            65% and 80% load 2.8% and 1.5% above the best peer's instead of 5.6% and 3.2%,
            the Mooncake trace's mean TTFT a little lower and its hit ratio 0.07 points
            lower on average, the rest level (README, "Engines that chunk prefills").
        chunk_caps: 1 (the default): where a worker's engine caps each prefill's chunk
            (``max_prefill_chunk``), the hold rule counts only the chunks a request would
            join and the batch term only the capped chunk; 0: both ignore the caps, as the
            policy did before engines reported them (README, "A cap on each prefill's
            chunk").
        join_hold: 1 (the default): with ``chunk_caps``, a holder whose next iteration the
            request joins keeps it (``joins_h``); 0: its chunks ahead are weighed as any
            backlog, against ``hold`` x the redo.
        transfer_cost: for clusters that can move KV between workers (as Mooncake's): a
            worker may fetch the longest cached prefix at this cost per token, in units of
            prefilling one; its miss term then becomes
            ``beta * (transfer_cost * (c* - c_w) + work(P - c*, c*))`` when lower, and the
            hold rule weighs a move by that fetch instead of the redone prefill. 1.0 (the
            default) = no transfers; the ``kvroute_fetch`` registry entry uses Mooncake's
            0.122. Only the replay simulator performs transfers.

    Measured (``bench/policy_jitter.py``, mean of rate jitters 0.98/1/1.02, 16 workers,
    against llm-d, Preble, CHWBL, SGLang, Dynamo and Mooncake without KV transfer; the full
    table is in the README): the best mean TTFT in all 20 cells (Mooncake trace and
    ``kvroute gen`` chat, agent, rag, fork at 50/65/80/95% load), the best p99 in 12, a hit
    ratio at least the best peer's in 6, all three in 6; on the Mooncake trace at 80%
    6.8 s / 48 s against llm-d's 17.8 s / 104 s (Preble's p99). The hit ratio is within
    0.01-0.22 points of the stickiest peer's on chat and rag. Those figures are with the
    replay caching replies, as engines do; every other figure in this docstring not marked
    so was measured with only prompts cached, which changes chat and agent traffic (chat at
    50%: kvroute's hit ratio 78.9% then, 83.1% now) and leaves rag, fork and the Mooncake
    trace within 1%. With clients that wait for their replies (the replay's ``--closed-loop``),
    chat and agent sessions keep every reply and all policies come within 0.3 points of the
    infinite cache; kvroute's hit ratio is then 0.03-0.11 points below the stickiest peer's
    (llm-d's in 23 of 24 cells, whose mean TTFT is 1.0-1.8x kvroute's there; README, "With
    clients that wait"): the sessions it moves off a busy holder. Against the earlier hold
    rule (whole cost, ``hold`` 0.75) this one raised the hit ratio 0.1-0.4 points on chat,
    agent and rag (seeds 1 and 2) at level mean TTFT, and p99 rose 1-5% on chat and rag.
    """

    miss_weight: float = 2.0
    stickiness: float = 1.0
    decode_weight: float = 32.0
    kv_weight: float = 0.1
    kv_decay: float = 1.0
    kv_fill_from: float = 0.4
    kv_fill_full: float = 0.8
    affinity_weight: float = 3.0
    attn: float = 3.3e-5
    hold: float = 3.0
    hold_min: float = 0.5
    batch_weight: float = 1.5
    batch_tokens: int = 8192
    transfer_cost: float = 1.0
    arrival_weight: float = 0.5
    prefill_s_per_token: float = 8.6e-5
    demand_horizon_s: float = 10.0
    replicate: float = 1.0
    spread_demand: float = 2.0
    tail_hold: float = 0.0
    churn_s: float = 0.3
    churn_full_s: float = 3.0
    chunked_prefill: float = 0.0
    chunk_caps: float = 1.0
    join_hold: float = 1.0
    name: str = "kvroute"
    # The same policy with replicate 0: its ranking says where a copy would be made.
    _moving: KvrouteCost | None = field(default=None, init=False, repr=False, compare=False)

    # The values ``kvroute tune`` tries for each parameter: a few steps either side of the
    # default, within the range the formula is meant for (``hold`` 1000: never leave a
    # holder for balance; ``attn`` is a property of the model and ``transfer_cost`` of the
    # cluster, so neither is tuned). The zeros reach the selfish corner (each request to its
    # least queued prefill plus its own, no externality, no growth of ``beta`` with the
    # queue): on chat and rag traffic 0.5-4% lower mean TTFT and up to 8% lower p99 for
    # 0.1-2.3 points of hit ratio, on agent traffic a collapse at 80-95% load (README,
    # "Tuning a peer"). Without them the grid could not find the former, nor could
    # ``--check`` on other traffic show the latter.
    TUNING: ClassVar[Mapping[str, tuple[float, ...]]] = {
        "miss_weight": (1.0, 1.5, 2.0, 3.0, 4.0),
        "stickiness": (0.0, 0.5, 1.0, 2.0),
        "decode_weight": (0.0, 8.0, 16.0, 32.0, 64.0),
        "kv_weight": (0.0, 0.05, 0.1, 0.2),
        "kv_decay": (0.5, 1.0, 2.0),
        "kv_fill_from": (0.0, 0.2, 0.4, 0.6),
        "kv_fill_full": (0.6, 0.8, 1.0),
        "affinity_weight": (0.0, 1.0, 3.0, 6.0),
        "hold": (1.0, 2.0, 3.0, 5.0, 10.0, 1000.0),
        "hold_min": (0.0, 0.2, 0.35, 0.5, 0.7),
        "batch_weight": (0.0, 0.75, 1.5, 3.0),
        "batch_tokens": (2048, 4096, 8192, 16384),
        "arrival_weight": (0.0, 0.5, 1.0, 2.0, 4.0),
        "demand_horizon_s": (0.0, 3.0, 10.0, 30.0),
        "spread_demand": (0.0, 1.0, 2.0, 4.0, 8.0),
        "tail_hold": (0.0, 0.8, 1.0, 1.5, 2.0),
        "churn_s": (0.0, 0.3, 1.0, 3.0),
        "churn_full_s": (0.0, 1.0, 3.0, 10.0),
    }

    def __post_init__(self) -> None:
        # The ranges the formula assumes (parameters come from users: ``kvroute:hold=2``).
        if not 0.0 <= self.kv_fill_from <= self.kv_fill_full <= 1.0:
            raise ValueError(f"kv_fill_from and kv_fill_full are cache fills with 0 <= "
                             f"kv_fill_from <= kv_fill_full <= 1; got {self.kv_fill_from} and "
                             f"{self.kv_fill_full}")
        if not 0.0 <= self.hold_min <= 1.0:
            raise ValueError(f"hold_min is a fraction of the prompt, in [0, 1]; got "
                             f"{self.hold_min}")
        if not 0.0 < self.transfer_cost <= 1.0:
            raise ValueError(f"transfer_cost is a fetch's cost against a prefill's, in (0, 1] "
                             f"(1: no transfers); got {self.transfer_cost}")
        if self.batch_tokens < 1:
            raise ValueError(f"batch_tokens must be >= 1; got {self.batch_tokens}")
        if not self.prefill_s_per_token > 0:
            raise ValueError(f"prefill_s_per_token must be > 0; got {self.prefill_s_per_token}")
        if not self.demand_horizon_s >= 0:
            raise ValueError(f"demand_horizon_s must be >= 0; got {self.demand_horizon_s}")
        if not self.tail_hold >= 0:
            raise ValueError(f"tail_hold must be >= 0 (0: off); got {self.tail_hold}")
        if not (self.churn_s >= 0 and self.churn_full_s >= 0):
            raise ValueError(f"churn_s and churn_full_s must be >= 0 (both 0: off); got "
                             f"{self.churn_s} and {self.churn_full_s}")
        if not self.spread_demand >= 0:
            raise ValueError(f"spread_demand must be >= 0; got {self.spread_demand}")
        if self.chunked_prefill not in (0.0, 1.0):
            raise ValueError(f"chunked_prefill is 1 (the engines chunk long prefills, as vLLM "
                             f"V1 does) or 0 (they admit a prompt whole); got "
                             f"{self.chunked_prefill}")
        if self.join_hold not in (0.0, 1.0):
            raise ValueError(f"join_hold is 1 (a holder whose next iteration the request joins "
                             f"keeps it) or 0 (weigh its backlog as any); got {self.join_hold}")
        if self.chunk_caps not in (0.0, 1.0):
            raise ValueError(f"chunk_caps is 1 (count the chunks an engine's cap lets a request "
                             f"join) or 0 (ignore the caps); got {self.chunk_caps}")
        if self.replicate not in (0.0, 1.0):
            raise ValueError(f"replicate is 1 (copy hot prefixes in the background) or 0 (move "
                             f"the request to make the copy); got {self.replicate}")
        if self.replicate:
            self._moving = replace(self, replicate=0.0)

    def rank(self, query: RouteQuery) -> Sequence[Scored]:
        """The ranking by the formula above: in C when it is built (the router's and the
        simulator's queries, whose loads and matches are dicts), else :meth:`rank_python`;
        both give the same workers in the same order with the same costs."""
        loads, matched = query.loads, query.matched_blocks
        if _native_rank is None or type(loads) is not dict or type(matched) is not dict:
            return self.rank_python(query)
        if not loads:
            return []
        params = (self.miss_weight, self.stickiness, self.decode_weight, self.kv_weight,
                  self.kv_decay, self.affinity_weight, self.attn, self.hold, self.hold_min,
                  self.batch_weight, self.batch_tokens, self.transfer_cost,
                  self.arrival_weight, self.prefill_s_per_token, self._demand_horizon,
                  self.kv_fill_from, self.kv_fill_full, self.tail_hold, self.churn_s,
                  self.churn_full_s, self.chunked_prefill, self.chunk_caps, self.join_hold)
        order, costs = _native_rank(params, loads, matched, query.prompt_tokens,
                                    query.block_size, query.affinity, query.family,
                                    query.prefix_rate, query.tail_work)
        return Ranking(order, costs)

    def rank_python(self, query: RouteQuery) -> Sequence[Scored]:
        """The formula in Python: the reference the C build is checked against."""
        p = query.prompt_tokens
        bs = query.block_size
        matched = query.matched_blocks
        loads = query.loads
        if not loads:
            return []
        mean_queued = sum(ld.queued for ld in loads.values()) / len(loads)
        beta = self.miss_weight * (1.0 + self.stickiness * mean_queued)
        fill = sum(ld.cache_fill for ld in loads.values()) / len(loads)
        ramp = self._kv_ramp(fill)
        kw = self.kv_weight / (1.0 + self.kv_decay * mean_queued) * ramp
        dw, attn = self.decode_weight, self.attn
        full_miss = beta * work(p, 0, attn)  # most workers match nothing
        # kw * kv_usage * capacity tokens == kw * blocks held * block size
        costs = {
            w: full_miss + ld.pending_prefill_tokens + dw * ld.busy + kw * ld.used_blocks * bs
            for w, ld in loads.items()
        }
        cached: dict[str, int] = {}
        for w, m in matched.items():
            if w in costs:
                c = cached[w] = min(m * bs, p)
                costs[w] += beta * work(p - c, c, attn) - full_miss
        top = max(cached.values(), default=0)  # c*: the longest prefix cached anywhere
        if top and self.transfer_cost < 1:
            # A worker may fetch the longest cached prefix instead of computing it.
            tc = self.transfer_cost
            fetched = beta * work(p - top, top, attn)
            for w in costs:
                c = cached.get(w, 0)
                if c < top:
                    own = beta * work(p - c, c, attn)
                    costs[w] -= max(0.0, own - fetched - beta * tc * (top - c))
        if self.batch_weight > 0 and mean_queued > 0:  # no queue, nobody to delay
            self._batch_delay(costs, cached, loads, p)
        if top and self.hold > 0:
            self._hold(costs, cached, top, loads, p, beta,
                       query.prefix_rate if self._demand_horizon else 0.0, query.tail_work)
        # Only what no worker caches yet is placed anew (cached prefixes: miss and hold terms).
        spread = self.affinity_weight * (mean_queued - 1.0) * (p - top)
        if spread > 0 and len(costs) > 1:  # only under load: the ordering costs a hash each
            aff = query.family
            step = spread / (len(costs) - 1)
            for r, w in enumerate(rendezvous_order(aff, costs)):
                costs[w] += r * step
        if self.arrival_weight > 0:
            self._arrivals(costs, cached, loads, p, fill)
        if top < self.hold_min * p:
            self._churn(costs, loads, ramp)
        return rank_by_cost(query, costs)

    @property
    def _demand_horizon(self) -> float:
        """The hold rule's demand horizon: none when copies are made in the background."""
        return 0.0 if self.replicate else self.demand_horizon_s

    def replica(self, query: RouteQuery, worker: str) -> tuple[str, int] | None:
        """With ``replicate``: the worker to copy the prompt's longest cached prefix to, in
        the background, and that prefix's length in tokens, when the request goes to a
        holder of it and its demand would have moved it to make the copy, or each holder
        would get more than ``spread_demand`` of its requests over ``demand_horizon_s``
        while the cluster has no queue (the spread rule: then the cheapest worker without
        it, if its prefill is idle); see the class docstring. Else None. Ranks a second
        time only for a prefix in demand."""
        moving = self._moving
        rate = query.prefix_rate
        if moving is None or not rate or not self.demand_horizon_s:
            return None
        loads = query.loads
        top = max((query.cached_tokens(w) for w in query.matched_blocks if w in loads),
                  default=0)
        if not top or query.cached_tokens(worker) < top:
            return None  # the request itself brings the prefix to its worker
        ranked = moving.rank(query)
        # The cheapest worker lacking it: the first in the ranking (a scan of all of them in
        # Python was most of a 1,000-worker decision for a prefix in demand).
        cheapest = next((s.worker for s in ranked if query.cached_tokens(s.worker) < top),
                        None)
        if cheapest is None:
            return None  # every worker holds it
        if cheapest == ranked[0].worker:
            return cheapest, top  # its demand would have moved the request there
        # The spread rule: the cheapest worker without it, while each holder would get more
        # than spread_demand of its requests over the horizon.
        holders = sum(1 for w in query.matched_blocks
                      if w in loads and query.cached_tokens(w) >= top)
        if not self.spread_demand or rate * self.demand_horizon_s < self.spread_demand * holders:
            return None
        if sum(ld.queued for ld in loads.values()) >= len(loads):
            return None  # the average worker has a queue: no spare prefill for a copy
        target = loads[cheapest]
        if target.queued or target.pending_prefill_tokens:
            return None  # a copy runs on idle prefill only, or it delays the target's requests
        return cheapest, top

    def transfer(self, query: RouteQuery, worker: str) -> tuple[str, int] | None:
        """Where ``worker`` fetches the prompt's longest cached prefix from (only with
        ``transfer_cost`` < 1: the ``kvroute_fetch`` variant, for clusters that can move KV
        between workers; see :func:`~kvroute.core.policies.base.fetch_plan`)."""
        return fetch_plan(query, worker, self.transfer_cost)

    def _batch_delay(self, costs: dict[str, float], cached: Mapping[str, int],
                     loads: Mapping[str, WorkerLoad], p: int) -> None:
        """The batch term: on a worker whose queue would be admitted in the same iteration as
        this request, its prefill delays each queued request's first token (see the class
        docstring). Adds to ``costs`` in place."""
        bw, attn, default_budget = self.batch_weight, self.attn, self.batch_tokens
        for w, ld in loads.items():
            if ld.queued:
                c = cached.get(w, 0)
                n = p - c
                room = (ld.max_batched_tokens or default_budget) - ld.pending_prefill_tokens
                if self._chunks(ld):
                    # its first chunk joins the queue's iteration (at most the engine's cap)
                    if room > 0:
                        first = min(n, room, self._cap(ld) or n)
                        costs[w] += bw * ld.queued * work(first, c, attn)
                elif n <= room:
                    costs[w] += bw * ld.queued * work(n, c, attn)

    def _chunks(self, ld: WorkerLoad) -> bool:
        """Whether ``ld``'s engine chunks long prefills (its ``prefill_mode``, else the
        policy's ``chunked_prefill``)."""
        mode = ld.prefill_mode
        return mode is PrefillMode.CHUNKED or (mode is PrefillMode.UNKNOWN
                                               and bool(self.chunked_prefill))

    def _cap(self, ld: WorkerLoad) -> int:
        """The cap on one prefill's chunk the policy counts on ``ld``'s worker (0: none)."""
        return ld.max_prefill_chunk if self.chunk_caps else 0

    def _joins(self, ld: WorkerLoad) -> bool:
        """Whether a request sent to ``ld``'s worker joins its next iteration whatever is
        queued there: its engine caps each prefill's chunk (``max_prefill_chunk``), and the
        chunks ahead, one per request waiting there and the running prefill's, leave room
        in the iteration."""
        cap = self._cap(ld)
        return bool(cap) and self._chunks(ld) \
            and (ld.waiting + 1) * cap < (ld.max_batched_tokens or self.batch_tokens)

    def _backlog(self, ld: WorkerLoad) -> float:
        """``backlog_w`` of the hold rule: the prefill a request sent to ``ld``'s worker
        waits for, in work units. All of the queued prefill, but where the request joins
        the next iteration (:meth:`_joins`), only the share of it the chunks ahead take:
        it does not wait them out (see the class docstring)."""
        pending = ld.pending_prefill_tokens
        b = pending + self.attn * ld.pending_prefill_context
        if pending and self._joins(ld):
            ahead = (ld.waiting + 1) * self._cap(ld)  # the chunks ahead in its iteration
            if ahead < pending:
                b *= ahead / pending
        return b

    def _kv_ramp(self, fill: float) -> float:
        """The KV term's share at the caches' mean ``fill``: ``ramp`` in the formula."""
        if fill >= self.kv_fill_full:
            return 1.0
        if fill <= self.kv_fill_from:
            return 0.0
        return (fill - self.kv_fill_from) / (self.kv_fill_full - self.kv_fill_from)

    def _arrivals(self, costs: dict[str, float], cached: Mapping[str, int],
                  loads: Mapping[str, WorkerLoad], p: int, fill: float) -> None:
        """The arrival term: the requests expected to reach each worker while this request's
        prefill runs there, each delayed by half of it on average, while the caches have
        room (see the class docstring). Adds to ``costs`` in place."""
        room = 1.0 - fill
        if room <= 0:
            return
        k = self.arrival_weight * room * self.prefill_s_per_token / 2.0
        attn = self.attn
        for w, ld in loads.items():
            if ld.arrival_rate > 0:
                c = cached.get(w, 0)
                wk = work(p - c, c, attn)
                costs[w] += k * ld.arrival_rate * wk * wk

    def _churn(self, costs: dict[str, float], loads: Mapping[str, WorkerLoad],
               ramp: float) -> None:
        """The churn term, for a prompt no worker caches most of: ``churn_s`` seconds of
        each worker's recent prefill (its ``prefill_rate``) while the caches have room,
        ``churn_full_s`` once they are full, linear between (``ramp``; see the class
        docstring). Adds to ``costs`` in place."""
        k = self.churn_s + (self.churn_full_s - self.churn_s) * ramp
        if k > 0:
            for w, ld in loads.items():
                costs[w] += k * ld.prefill_rate

    def _hold(self, costs: dict[str, float], cached: dict[str, int], top: int,
              loads: Mapping[str, WorkerLoad], p: int, beta: float, rate: float,
              tail: float = math.inf) -> None:
        """The hold rule: keep a request on its longest cached prefix when that is most of
        the prompt, the holder has a free batch slot and no worker's queued prefill is
        shorter by ``hold`` x the prefill it would redo, or its fetch when cheaper, counting
        the holder's backlog once more per request the prefix's demand ``rate`` brings over
        ``demand_horizon_s``; with ``tail_hold``, not when that would put its first token
        in the tail ``tail`` (``RouteQuery.tail_work``) and a move would not (see the class
        docstring). ``top`` is the longest cached prefix. Rewrites ``costs`` in place."""
        if top < self.hold_min * p:
            return
        holder = min((w for w, c in cached.items() if c == top), key=costs.__getitem__)
        cheapest = min(costs, key=costs.__getitem__)
        c0 = cached.get(cheapest, 0)
        if c0 >= top:
            return  # the cheapest worker holds as long a prefix: nothing to keep
        lh = loads[holder]
        if lh.max_running and lh.occupied >= lh.max_running:
            return  # no batch slot: the request would wait for one whatever its prefix
        if self.join_hold and self._joins(lh):
            # It joins the holder's next iteration: no move saves more than the chunks ahead.
            costs[holder] = math.nextafter(costs[cheapest], -math.inf)
            return
        attn = self.attn
        n0, n = p - c0, p - top
        redo = beta * (work(n0, c0, attn) - work(n, top, attn))
        redo = min(redo, beta * self.transfer_cost * (top - c0))  # or fetch the prefix
        demand = 1.0 + self.demand_horizon_s * rate
        lm = loads[cheapest]
        # The backlog in work units, its attention included, as the redo: counted in tokens,
        # a holder prefilling a 190k-token prompt (68 s) looked 4x shorter than it was.
        queued_h = self._backlog(lh)
        queued_m = self._backlog(lm)
        if (queued_h - queued_m) * demand >= self.hold * redo:
            return
        if self.tail_hold and tail < math.inf:
            # Held, its first token would come in the tail, and on m it would not: let it go.
            limit = self.tail_hold * tail
            if queued_m + work(n0, c0, attn) <= limit < queued_h + work(n, top, attn):
                return
        costs[holder] = math.nextafter(costs[cheapest], -math.inf)
