/*
 * The keyed outbox's order with runs, as a model for spin (`.ci/model-check` runs it).
 *
 * One key's N events (keys are independent: one is enough), two relay workers (or
 * relays) that claim runs of them, publish them through a broker, and record the
 * outcomes. The broker acknowledges a message (it holds it), or answers with an error
 * or not at all, the message landed or not (a timeout: the relay retries the first,
 * and leaves the second claimed until its lease ends). A lease may end at any moment,
 * and a worker may pause anywhere (a paused worker is one that has not taken its next
 * step yet), so a stale owner keeps sending what it claimed.
 *
 * What it checks, in every interleaving:
 *  - ORDER: the broker takes an event's first copy only once it holds a copy of every
 *    earlier event of its key (a consumer that deduplicates on the event id sees each
 *    key's events in order);
 *  - FENCING: a SENT event stays SENT, and only an event the broker holds is SENT.
 *
 * Each protection can be left out, to see the check fail without it:
 *  -DNO_IN_TURN     a claim may take an event whose predecessor is not SENT;
 *  -DPIPELINED      a run is not stopped at its first event that did not go: the
 *                   events after it are sent all the same (a run handed to the
 *                   broker at once);
 *  -DSEND_BROKEN    a batch claimed ahead is sent even when its key's events in the
 *                   batch before did not all go;
 *  -DNO_FENCING     outcomes are recorded without the generation and lease check.
 * And one that keeps it another way:
 *  -DATOMIC_RUNS    a run goes to the broker at once, and the broker stores all of it
 *                   or none (JetStream's atomic batches, a Kafka transaction).
 *
 * It follows the claim statements (the key's first event not SENT as a head, READY or
 * with its lease over; its run: the events after it that are READY or with their
 * lease over, at most RUNLEN; a continuation after the tail of the batch in flight
 * while that tail is still the worker's), the relay's send (a key's events one at a
 * time, the run stopped at its first event that did not go), its claim ahead
 * (recording the outcomes before, then claiming, in one transaction, while a batch is
 * out; the batch claimed ahead sent next only if every event of the batch out went)
 * and its recording (the acknowledged prefix SENT, an event answered with an error
 * retried, one unanswered left claimed, the rest handed back). Time is left out: a
 * retry's delay, a scheduled time or a renewal only restrict when a step may happen,
 * and every order of the steps is explored. A DEAD event holds its key as a READY one
 * that is never claimed does.
 *
 * Parameters: N events (at most 4), runs of at most RUNLEN, each event claimed at most
 * MAXGEN times (so a takeover, and a stale owner beside the new one, are explored).
 */

#ifndef N
#define N 3
#endif
#ifndef RUNLEN
#define RUNLEN 2
#endif
#ifndef MAXGEN
#define MAXGEN 2
#endif
#define WORKERS 2

mtype = { READY, INPROGRESS, SENT };
/* What the sink answered for an event: acknowledged, refused, in doubt, or not sent. */
mtype = { ACK, FAIL, DOUBT, HELD };

mtype status[N];
bool live[N];        /* INPROGRESS, its lease not over */
byte gen[N];
bool delivered[N];   /* the broker holds a copy */

/* A worker's batch: its events in id order, the generation each was claimed at, and
   what the sink said of each. */
typedef Batch {
    byte ids[RUNLEN];
    byte gens[RUNLEN];
    mtype results[RUNLEN];
    byte size
};
Batch out[WORKERS];     /* being sent */
Batch before[WORKERS];  /* sent, its outcomes not recorded yet */
Batch ahead[WORKERS];   /* claimed while `out` is out */

/* Scratch, used only inside atomic steps, never across a choice: not part of the
   state. */
hidden byte k, e;
#ifdef NO_IN_TURN
byte head;
#endif

#define claimable(e) (gen[e] < MAXGEN && (status[e] == READY || status[e] == INPROGRESS && !live[e]))
#define owned(e, g) (status[e] == INPROGRESS && live[e] && gen[e] == g)

#ifdef NO_FENCING
#define fenced(e, g) true
#else
#define fenced(e, g) owned(e, g)
#endif

/* The broker takes a copy of event e: its first copy only after every earlier one's. */
inline deliver(e) {
    if
    :: !delivered[e] ->
        k = 0;
        do
        :: k < e -> assert(delivered[k]); k++
        :: else -> break
        od;
        delivered[e] = true
    :: else -> skip
    fi
}

/* From event `from` on: the events that may go, at most RUNLEN. */
inline take_run(from, b) {
    k = from;
    do
    :: b.size < RUNLEN && k < N && claimable(k) ->
        gen[k]++;
        status[k] = INPROGRESS;
        live[k] = true;
        b.ids[b.size] = k;
        b.gens[b.size] = gen[k];
        b.size++;
        k++
    :: else -> break
    od
}

/* A claim from the READY index or of expired claims: the key's head and its run. */
inline claim_fresh(b) {
    b.size = 0;
#ifdef NO_IN_TURN
    /* any event that may be claimed, whatever comes before it (chosen in a variable
       that is part of the state: spin tells the choices apart) */
    if
    :: N > 2 -> head = 2
    :: N > 1 -> head = 1
    :: head = 0
    fi;
    k = head;
    head = 0;
#else
    k = 0;
    do
    :: k < N && status[k] == SENT -> k++
    :: else -> break
    od;
#endif
    if
    :: k < N && claimable(k) -> take_run(k, b)
    :: else -> skip
    fi
}

/* Continuing the run of batch `o` (out) after its tail, while that tail is still ours. */
inline claim_after(o, b) {
    b.size = 0;
    e = o.ids[o.size - 1];
    if
    :: owned(e, o.gens[o.size - 1]) && e + 1 < N && status[e + 1] != SENT -> take_run(e + 1, b)
    :: else -> skip
    fi
}

/* Recording the outcomes of a batch sent, in one statement. */
inline record(b) {
    k = 0;
    do
    :: k < b.size ->
        e = b.ids[k];
        if
        :: fenced(e, b.gens[k]) && b.results[k] == ACK ->
            assert(delivered[e]);
            status[e] = SENT; live[e] = false
        :: fenced(e, b.gens[k]) && (b.results[k] == FAIL || b.results[k] == HELD) ->
            /* retried, or handed back */
            assert(status[e] != SENT);
            status[e] = READY; live[e] = false
        :: else -> skip   /* stale, or in doubt: the claim stands until its lease ends */
        fi;
        k++
    :: else -> break
    od;
    b.size = 0
}

/* Handing back a batch claimed ahead that will not be sent. */
inline hand_back(b) {
    k = 0;
    do
    :: k < b.size ->
        e = b.ids[k];
        if
        :: fenced(e, b.gens[k]) -> assert(status[e] != SENT); status[e] = READY; live[e] = false
        :: else -> skip
        fi;
        k++
    :: else -> break
    od;
    b.size = 0
}

#ifdef ATOMIC_RUNS
/* The broker takes the batch out, in order (`i` ends past it). */
inline deliver_run() {
    i = 0;
    do
    :: i < out[me].size -> deliver(out[me].ids[i]); i++
    :: else -> break
    od
}

/* The sink's answer for the batch out: `first` for its first event, `rest` for the
   others (`i` ends past it). */
inline answer_run(first, rest) {
    out[me].results[0] = first;
    i = 1;
    do
    :: i < out[me].size -> out[me].results[i] = rest; i++
    :: else -> break
    od
}
#endif

proctype Worker(byte me) {
    byte i;
    bool stopped, all_went, claimed_ahead;

    do
    :: /* the claim step: the outcomes before recorded, and a batch claimed */
        atomic { record(before[me]); claim_fresh(out[me]) };
        do
        :: out[me].size == 0 -> break
        :: out[me].size > 0 ->
            /* the publish step, one event of the run at a time, and the batch
               transaction beside it */
            i = 0; stopped = false; claimed_ahead = false;
            do
#ifdef ATOMIC_RUNS
            :: i < out[me].size ->
                /* the whole run at once, to a broker that stores all of it or none */
                if
                :: atomic { deliver_run(); answer_run(ACK, ACK) }
                :: atomic { deliver_run(); answer_run(DOUBT, DOUBT) }
                :: atomic { deliver_run(); answer_run(FAIL, HELD) }
                :: atomic { answer_run(DOUBT, DOUBT) }
                :: atomic { answer_run(FAIL, HELD) }
                fi
#else
            :: i < out[me].size ->
                if
                :: stopped -> out[me].results[i] = HELD
                :: !stopped ->
                    if
                    :: true -> atomic { deliver(out[me].ids[i]); out[me].results[i] = ACK }
                    :: true -> atomic { deliver(out[me].ids[i]); out[me].results[i] = FAIL }
                    :: out[me].results[i] = FAIL
                    :: true -> atomic { deliver(out[me].ids[i]); out[me].results[i] = DOUBT }
                    :: out[me].results[i] = DOUBT
                    fi;
#ifndef PIPELINED
                    stopped = out[me].results[i] != ACK
#endif
                fi;
                i++
#endif
            :: !claimed_ahead ->
                /* recording the batch before, then claiming ahead: one transaction */
                atomic {
                    record(before[me]);
                    if
                    :: claim_after(out[me], ahead[me])
                    :: claim_fresh(ahead[me])
                    fi
                };
                claimed_ahead = true
            :: i == out[me].size -> break
            od;
            atomic {
                all_went = true;
                k = 0;
                do
                :: k < out[me].size -> all_went = all_went && out[me].results[k] == ACK; k++
                :: else -> break
                od;
                i = 0
            };
#ifdef SEND_BROKEN
            all_went = true;
#endif
            /* settle: the outcomes before recorded now if not beside the send, this
               batch's pending; what was claimed ahead goes next if every event of this
               batch went, and back otherwise */
            atomic {
                record(before[me]);
                before[me].size = out[me].size;
                k = 0;
                do
                :: k < out[me].size ->
                    before[me].ids[k] = out[me].ids[k];
                    before[me].gens[k] = out[me].gens[k];
                    before[me].results[k] = out[me].results[k];
                    k++
                :: else -> break
                od;
                out[me].size = 0
            };
            if
            :: atomic { ahead[me].size > 0 && all_went ->
                out[me].size = ahead[me].size;
                k = 0;
                do
                :: k < ahead[me].size ->
                    out[me].ids[k] = ahead[me].ids[k];
                    out[me].gens[k] = ahead[me].gens[k];
                    k++
                :: else -> break
                od;
                ahead[me].size = 0 }
            :: ahead[me].size > 0 && !all_went -> atomic { hand_back(ahead[me]) }
            :: ahead[me].size == 0 -> skip
            fi
        od
    od
}

/* A lease ends: the worker paused, lost its database, or renewed too late. */
active proctype Leases() {
    do
    :: atomic { status[0] == INPROGRESS && live[0] -> live[0] = false }
#if N > 1
    :: atomic { status[1] == INPROGRESS && live[1] -> live[1] = false }
#endif
#if N > 2
    :: atomic { status[2] == INPROGRESS && live[2] -> live[2] = false }
#endif
#if N > 3
    :: atomic { status[3] == INPROGRESS && live[3] -> live[3] = false }
#endif
    od
}

init {
    atomic {
        k = 0;
        do
        :: k < N -> status[k] = READY; k++
        :: else -> break
        od;
        k = 0;
        run Worker(0);
        run Worker(1)
    }
}
