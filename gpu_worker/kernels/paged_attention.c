/* Paged attention for the CPU, float32, over the whole step in one call.
 *
 * The semantics are gpu_worker/attention/backend.py's: the step's T rows are sequences'
 * chunks, sequence s owning rows query_start_loc[s] .. query_start_loc[s+1]-1 at the last
 * positions before context_lens[s]; a row at position p sees its own sequence's keys at
 * positions j <= p (and j > p - window with a sliding window), read through the block
 * table from the caches [num_blocks, block_size, kv_heads, head_dim]; query head h reads
 * KV head h / (heads / kv_heads); scores are q.k * scale, then softcap * tanh(s / softcap)
 * with a softcap.
 *
 * Each (row, head) is computed alone, the same way whatever else is in the step, how it
 * was chunked, or how many threads run: q.k is summed over head_dim in 8 lanes added in a
 * fixed order, the softmax's maximum and denominator and P.V run over the keys in
 * position order. So a row's bits are the same alone, in any batch, in a prefill chunk or
 * a decode step (batch invariance by construction), and every sum is float32.
 *
 * For speed, a work item is a tile of up to MAX_TILE (row, head) pairs of one sequence
 * and one KV head (a few consecutive rows times the heads that share the KV head): each
 * key is read once for the whole tile, its dot products run twelve at a time (three
 * queries by four keys, the next block's keys fetched meanwhile), and the
 * tile's keys and values stay in cache while each pair's P.V runs in registers. Tiling
 * changes which pairs share a read, never a pair's arithmetic. The scores' maximum is
 * taken after q.k, over the stored scores. The threads take the items in order, one at a
 * time, each knowing its next one so as to fetch that one's keys meanwhile (Ahead).
 *
 * Where the CPU has AVX-512 (wide_vectors, simd.h), q.k holds two keys a 512-bit register
 * (eight keys a block), and P.V runs the heads of one row together, each value read once
 * for all of them: each lane still computes the AVX2 lane's chain, so the bits are the
 * AVX2 loops' (tested bit for bit against them).
 */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

/* Queries sharing one work item: up to MAX_TILE (row, head) pairs of one sequence and one
 * KV head, so each key and value read from the cache serves all of them. */
#define MAX_TILE 16

typedef struct {
    const float *q;   /* the query, head_dim floats */
    float *o;         /* its output row */
    float *scores;    /* its keys' scores, then weights: scores[j - first] */
    int64_t first, position;
} Query;

/* The cache slot of position j of a sequence (block table `blocks`), walked without a
 * division per key by the loops below. */
#define SLOT(blocks, j) ((int64_t)(blocks)[(j) / block_size] * block_size + (j) % block_size)

#define INLINE static inline __attribute__((always_inline))

/* The keys of the item a thread takes next, asked for a few cache lines at a time while it
 * runs this item's P.V, which reads only what q.k brought into cache: memory would sit idle
 * there, and the next item's q.k would wait on it block after block. Decode steps read
 * every key from memory; the default model's attention, a step, alternated in one process:
 * batch 64 at context 128 11.5 -> 10.1 ms, at 48 4.6 -> 3.8 ms, batch 8 at 1,024 12.8 ->
 * 10.7 ms; a 512-token prompt (its keys in cache, none fetched) unchanged. */
typedef struct {
    const float *cache;     /* the key cache at the next item's KV head */
    const int32_t *blocks;  /* its sequence's block table */
    int64_t block_size, token_stride, lines; /* lines: a key's 64-byte lines */
    int64_t j, last, line;  /* the next one: line `line` of key j, until key `last` */
    const float *key;       /* key j */
} Ahead;

#define AHEAD_LINES 4 /* lines asked for per key of P.V */

static inline void ahead_step(Ahead *ahead) {
    for (int n = 0; n < AHEAD_LINES && ahead->j <= ahead->last; n++) {
        _mm_prefetch((const char *)(ahead->key + 16 * ahead->line), _MM_HINT_T1);
        if (++ahead->line < ahead->lines) continue;
        ahead->line = 0;
        const int64_t block_size = ahead->block_size;
        if (++ahead->j % block_size)
            ahead->key += ahead->token_stride;
        else if (ahead->j <= ahead->last)
            ahead->key = ahead->cache + SLOT(ahead->blocks, ahead->j) * ahead->token_stride;
    }
}

/* ---- P.V -------------------------------------------------------------------------------- */

/* qr->o = sum over its keys j, in order, of weight_j * v_j, divided by the denominator
 * (the weights' sum in the same order, added by the first pass beside its FMAs): head_dim
 * in chunks of up to 64 floats, 8 registers each. */
static void weighted_values(Query *qr, const float *value_cache, const int32_t *blocks,
                            int64_t block_size, int64_t token_stride, int64_t kv_offset,
                            int64_t head_dim, Ahead *ahead) {
    float denominator = 0.0f;
    for (int64_t c = 0; c < head_dim; c += 64) {
        const int64_t lanes = (head_dim - c < 64 ? head_dim - c : 64) / 8;
        __m256 acc[8];
        for (int64_t i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t j = qr->first; j <= qr->position;) {
            const int64_t block = j / block_size;
            const int64_t end = (block + 1) * block_size - 1 < qr->position ? (block + 1) * block_size - 1 : qr->position;
            const float *v = value_cache + SLOT(blocks, j) * token_stride + kv_offset + c;
            for (; j <= end; j++, v += token_stride) {
                ahead_step(ahead);
                const float w = qr->scores[j - qr->first];
                if (c == 0) denominator += w;
                const __m256 weight = _mm256_set1_ps(w);
                if (lanes == 8) {
                    for (int64_t i = 0; i < 8; i++)
                        acc[i] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(v + 8 * i), acc[i]);
                } else {
                    for (int64_t i = 0; i < lanes; i++)
                        acc[i] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(v + 8 * i), acc[i]);
                }
            }
        }
        const __m256 denominators = _mm256_set1_ps(denominator);
        for (int64_t i = 0; i < lanes; i++)
            _mm256_storeu_ps(qr->o + c + 8 * i, _mm256_div_ps(acc[i], denominators));
    }
}

/* Heads of one row at most, run together by the AVX-512 P.V: 16 accumulators + 4 values
 * + 1 weight of the 32 registers. */
#define ROW_HEADS 4

/* weighted_values for NQ queries that see the same keys, head_dim % 64 == 0, in 512-bit
 * registers: each value is read once for all of them, and NQ x 4 chains hide the FMA's
 * latency. Each lane's chain is the one above, and so is each denominator (every chunk
 * adds the same weights in the same order). */
AVX512 INLINE void row_values(Query *qs, const int NQ, const float *value_cache,
                              const int32_t *blocks, int64_t block_size, int64_t token_stride,
                              int64_t kv_offset, int64_t head_dim, Ahead *ahead) {
    const int64_t first = qs[0].first, position = qs[0].position;
    for (int64_t c = 0; c < head_dim; c += 64) {
        float denominator[ROW_HEADS] = {0.0f};
        __m512 acc[ROW_HEADS][4];
        for (int i = 0; i < NQ; i++)
            for (int l = 0; l < 4; l++) acc[i][l] = _mm512_setzero_ps();
        for (int64_t j = first; j <= position;) {
            const int64_t block = j / block_size;
            const int64_t end = (block + 1) * block_size - 1 < position ? (block + 1) * block_size - 1 : position;
            const float *v = value_cache + SLOT(blocks, j) * token_stride + kv_offset + c;
            for (; j <= end; j++, v += token_stride) {
                ahead_step(ahead);
                const __m512 values[4] = {_mm512_loadu_ps(v), _mm512_loadu_ps(v + 16),
                                          _mm512_loadu_ps(v + 32), _mm512_loadu_ps(v + 48)};
                for (int i = 0; i < NQ; i++) {
                    const float w = qs[i].scores[j - first];
                    denominator[i] += w;
                    const __m512 weight = _mm512_set1_ps(w);
                    for (int l = 0; l < 4; l++) acc[i][l] = _mm512_fmadd_ps(weight, values[l], acc[i][l]);
                }
            }
        }
        for (int i = 0; i < NQ; i++) {
            const __m512 denominators = _mm512_set1_ps(denominator[i]);
            for (int l = 0; l < 4; l++)
                _mm512_storeu_ps(qs[i].o + c + 16 * l, _mm512_div_ps(acc[i][l], denominators));
        }
    }
}

AVX512 static void row_values_of(Query *qs, int nq, const float *value_cache,
                                 const int32_t *blocks, int64_t block_size,
                                 int64_t token_stride, int64_t kv_offset, int64_t head_dim,
                                 Ahead *ahead) {
    switch (nq) {
    case 4: row_values(qs, 4, value_cache, blocks, block_size, token_stride, kv_offset, head_dim, ahead); break;
    case 3: row_values(qs, 3, value_cache, blocks, block_size, token_stride, kv_offset, head_dim, ahead); break;
    case 2: row_values(qs, 2, value_cache, blocks, block_size, token_stride, kv_offset, head_dim, ahead); break;
    default: row_values(qs, 1, value_cache, blocks, block_size, token_stride, kv_offset, head_dim, ahead); break;
    }
}

/* ---- q.k -------------------------------------------------------------------------------- */

/* Ask for `count` cache slots' head_dim floats from p on (slots token_stride apart). */
#define prefetch_slots(p, count, token_stride, head_dim, hint)                       \
    do {                                                                              \
        for (int slot_ = 0; slot_ < (count); slot_++)                                 \
            for (int64_t at_ = 0; at_ < (head_dim); at_ += 16)                        \
                _mm_prefetch((const char *)((p) + slot_ * (token_stride) + at_), hint); \
    } while (0)

/* lanes_sum (simd.h) of a, b, c and d at once, each added in exactly its order. */
static inline __m128 lanes_sums4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 ab = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
    const __m256 cd = _mm256_add_ps(_mm256_permute2f128_ps(c, d, 0x20), _mm256_permute2f128_ps(c, d, 0x31));
    /* low half: a's and c's (l0+l4)+(l2+l6), (l1+l5)+(l3+l7); high half: b's and d's */
    const __m256 pairs = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                       _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 sums = _mm256_hadd_ps(pairs, pairs); /* a c a c | b d b d */
    return _mm_unpacklo_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1));
}

/* lanes_sum of the eight keys whose 8 lanes lie two a register in p[0..3] (key 2i in p[i]'s
 * low half, 2i+1 in its high half), each added in exactly its order. */
AVX512 INLINE __m256 lanes_sums8(const __m512 p[4]) {
    /* 128-bit lane i: key i's l0+l4 .. l3+l7 (keys 0-3, then 4-7) */
    const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(p[0], p[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(p[0], p[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(p[2], p[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm512_shuffle_f32x4(p[2], p[3], _MM_SHUFFLE(3, 1, 3, 1)));
    /* lane i: key i's (l0+l4)+(l2+l6), (l1+l5)+(l3+l7), then key i+4's */
    const __m512 pairs = _mm512_add_ps(_mm512_shuffle_ps(low, high, _MM_SHUFFLE(1, 0, 1, 0)),
                                       _mm512_shuffle_ps(low, high, _MM_SHUFFLE(3, 2, 3, 2)));
    /* lane i: key i's sum, key i+4's sum (twice) */
    const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(pairs, pairs, _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm512_shuffle_ps(pairs, pairs, _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_castps512_ps256(_mm512_permutexvar_ps(order, sums));
}

/* Keep qr's scores of keys j .. j + keys - 1 (scores[key]) that it sees, softcapped: a
 * whole block inside its range without a softcap in one copy. */
INLINE void keep_scores(Query *qr, const float *scores, int keys, const int BLOCK, int64_t j,
                        float softcap) {
    if (keys == BLOCK && !(softcap > 0.0f) && j >= qr->first && j + BLOCK - 1 <= qr->position) {
        __builtin_memcpy(qr->scores + (j - qr->first), scores, BLOCK * sizeof(float));
        return;
    }
    for (int key = 0; key < keys; key++) {
        const int64_t position = j + key;
        if (position < qr->first || position > qr->position) continue;
        float score = scores[key];
        if (softcap > 0.0f) score = softcap * tanhf(score / softcap);
        qr->scores[position - qr->first] = score;
    }
}

/* Keys and queries of one block of q.k: QUERIES x KEYS independent FMA chains (12 of the
 * 16 registers) hide the FMA's latency, and each key is loaded once for all its queries. */
#define KEYS 4
#define QUERIES 3
/* AVX-512: two keys a register, so twice the keys for the same 12 accumulators. */
#define WIDE_KEYS 8

/* Scores of `keys` (1 .. KEYS) consecutive cache slots from k (position j onwards) for
 * NQ (1 .. QUERIES) queries: each one query's sum over head_dim in 8 lanes, as one chain
 * whatever the block (a missing key repeats the last one and is not kept). */
INLINE void score_block(Query *tile, const int NQ, const float *k, int64_t token_stride,
                        int keys, int64_t j, int64_t head_dim, float scale, float softcap) {
    const float *k1 = k + (keys > 1 ? 1 : 0) * token_stride;
    const float *k2 = k + (keys > 2 ? 2 : keys - 1) * token_stride;
    const float *k3 = k + (keys > 3 ? 3 : keys - 1) * token_stride;
    __m256 acc[QUERIES][KEYS];
    for (int i = 0; i < NQ; i++)
        for (int key = 0; key < KEYS; key++) acc[i][key] = _mm256_setzero_ps();
    for (int64_t c = 0; c < head_dim; c += 8) {
        const __m256 kc[KEYS] = {_mm256_loadu_ps(k + c), _mm256_loadu_ps(k1 + c),
                                 _mm256_loadu_ps(k2 + c), _mm256_loadu_ps(k3 + c)};
        for (int i = 0; i < NQ; i++) {
            const __m256 qc = _mm256_loadu_ps(tile[i].q + c);
            for (int key = 0; key < KEYS; key++) acc[i][key] = _mm256_fmadd_ps(qc, kc[key], acc[i][key]);
        }
    }
    for (int i = 0; i < NQ; i++) {
        float scores[KEYS];
        _mm_storeu_ps(scores, _mm_mul_ps(lanes_sums4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]),
                                         _mm_set1_ps(scale)));
        keep_scores(&tile[i], scores, keys, KEYS, j, softcap);
    }
}

/* score_block for up to WIDE_KEYS keys, two a 512-bit register: lane l of key 2i in
 * register i's low half, of key 2i+1 in its high half, each the same chain as there. */
AVX512 INLINE void wide_score_block(Query *tile, const int NQ, const float *k,
                                    int64_t token_stride, int keys, int64_t j,
                                    int64_t head_dim, float scale, float softcap) {
    const float *key_at[WIDE_KEYS];
    for (int key = 0; key < WIDE_KEYS; key++)
        key_at[key] = k + (key < keys ? key : keys - 1) * token_stride;
    __m512 acc[QUERIES][WIDE_KEYS / 2];
    for (int i = 0; i < NQ; i++)
        for (int p = 0; p < WIDE_KEYS / 2; p++) acc[i][p] = _mm512_setzero_ps();
    for (int64_t c = 0; c < head_dim; c += 8) {
        __m512 kc[WIDE_KEYS / 2];
        for (int p = 0; p < WIDE_KEYS / 2; p++)
            kc[p] = joined(_mm256_loadu_ps(key_at[2 * p] + c), _mm256_loadu_ps(key_at[2 * p + 1] + c));
        for (int i = 0; i < NQ; i++) {
            const __m512 qc = _mm512_broadcast_f32x8(_mm256_loadu_ps(tile[i].q + c));
            for (int p = 0; p < WIDE_KEYS / 2; p++) acc[i][p] = _mm512_fmadd_ps(qc, kc[p], acc[i][p]);
        }
    }
    for (int i = 0; i < NQ; i++) {
        float scores[WIDE_KEYS];
        _mm256_storeu_ps(scores, _mm256_mul_ps(lanes_sums8(acc[i]), _mm256_set1_ps(scale)));
        keep_scores(&tile[i], scores, keys, WIDE_KEYS, j, softcap);
    }
}

static void score_keys(Query *tile, int nq, const float *k, int64_t token_stride, int keys,
                       int64_t j, int64_t head_dim, float scale, float softcap) {
    switch (nq) {
    case 3: score_block(tile, 3, k, token_stride, keys, j, head_dim, scale, softcap); break;
    case 2: score_block(tile, 2, k, token_stride, keys, j, head_dim, scale, softcap); break;
    default: score_block(tile, 1, k, token_stride, keys, j, head_dim, scale, softcap); break;
    }
}

AVX512 static void wide_score_keys(Query *tile, int nq, const float *k, int64_t token_stride,
                                   int keys, int64_t j, int64_t head_dim, float scale,
                                   float softcap) {
    switch (nq) {
    case 3: wide_score_block(tile, 3, k, token_stride, keys, j, head_dim, scale, softcap); break;
    case 2: wide_score_block(tile, 2, k, token_stride, keys, j, head_dim, scale, softcap); break;
    default: wide_score_block(tile, 1, k, token_stride, keys, j, head_dim, scale, softcap); break;
    }
}

/* ---- softmax ---------------------------------------------------------------------------- */

/* The largest of count scores, NaNs passed over (as `if (s > top) top = s` in order
 * would find it), -inf for none. */
static float top_score(const float *scores, int64_t count) {
    __m256 tops = _mm256_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 8 <= count; j += 8) tops = _mm256_max_ps(_mm256_loadu_ps(scores + j), tops);
    float lanes[8], top = -INFINITY;
    _mm256_storeu_ps(lanes, tops);
    for (int i = 0; i < 8; i++)
        if (lanes[i] > top) top = lanes[i];
    for (; j < count; j++)
        if (scores[j] > top) top = scores[j];
    return top;
}

/* scores[j] = e^(scores[j] - top) for each of qr's keys, 8 at a time. */
static void exponentiate(Query *qr) {
    const int64_t count = qr->position - qr->first + 1;
    const float top_value = top_score(qr->scores, count);
    const __m256 top = _mm256_set1_ps(top_value);
    int64_t j = 0;
    for (; j + 8 <= count; j += 8)
        _mm256_storeu_ps(qr->scores + j, exp_lanes(_mm256_sub_ps(_mm256_loadu_ps(qr->scores + j), top)));
    if (j < count) {
        float rest[8] = {0};
        for (int64_t i = j; i < count; i++) rest[i - j] = qr->scores[i] - top_value;
        _mm256_storeu_ps(rest, exp_lanes(_mm256_loadu_ps(rest)));
        for (int64_t i = j; i < count; i++) qr->scores[i] = rest[i - j];
    }
}

/* ---- entry point ------------------------------------------------------------------------ */

/* A step's work items: (sequence, KV head, part of its heads, block of rows), listed per
 * sequence; item_start[s] is sequence s's first. */
typedef struct {
    const int64_t *item_start;
    const int32_t *query_start_loc, *context_lens;
    int64_t tile_rows, head_parts, sliding_window;
} Items;

typedef struct {
    int64_t seq, row_begin, row_end; /* rows [row_begin, row_end) of the sequence's chunk */
    int64_t part, kv_head;
    int64_t lo, hi; /* the keys its rows see, together */
} Item;

/* The row's first key: 0, or the window's start. */
static inline int64_t first_key(int64_t position, int64_t sliding_window) {
    return sliding_window > 0 && position - sliding_window + 1 > 0 ? position - sliding_window + 1 : 0;
}

/* Item `item`, its sequence found from `seq` (any index; the nearer, the faster). */
static Item item_at(const Items *items, int64_t item, int64_t seq) {
    while (items->item_start[seq + 1] <= item) seq++;
    while (items->item_start[seq] > item) seq--;
    const int64_t rows = items->query_start_loc[seq + 1] - items->query_start_loc[seq];
    const int64_t row_blocks = (rows + items->tile_rows - 1) / items->tile_rows;
    int64_t local = item - items->item_start[seq];
    Item it;
    it.seq = seq;
    it.row_begin = local % row_blocks * items->tile_rows;
    it.row_end = it.row_begin + items->tile_rows < rows ? it.row_begin + items->tile_rows : rows;
    local /= row_blocks;
    it.part = local % items->head_parts;
    it.kv_head = local / items->head_parts;
    const int64_t before = items->context_lens[seq] - rows; /* keys before the chunk */
    it.lo = first_key(before + it.row_begin, items->sliding_window);
    it.hi = before + it.row_end - 1;
    return it;
}

/* head_dim % 8 == 0; all tensors contiguous float32 (int32 for the metadata).
 * Returns 0, or -1 when scratch could not be allocated. */
int paged_attention(const float *query, const float *key_cache, const float *value_cache,
                    const int32_t *block_table, int64_t table_width,
                    const int32_t *query_start_loc, const int32_t *context_lens,
                    int64_t num_seqs, int64_t num_heads,
                    int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                    int64_t max_context_len, float scale, float softcap,
                    int64_t sliding_window, float *out, int num_threads) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim; /* floats per cache slot */
    const int wide = wide_vectors(-1);
    const int wide_values = wide && head_dim % 64 == 0;
    const int block_keys = wide ? WIDE_KEYS : KEYS;
    /* Rows per item: as many as fit MAX_TILE queries with the group's heads. */
    const int64_t tile_rows = group >= MAX_TILE ? 1 : MAX_TILE / group;
    const int64_t heads_per_item = group >= MAX_TILE ? MAX_TILE : group;
    const int64_t head_parts = (group + heads_per_item - 1) / heads_per_item;
    int64_t *item_start = malloc((size_t)(num_seqs + 1) * sizeof(int64_t));
    if (!item_start) return -1;
    item_start[0] = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t rows = query_start_loc[s + 1] - query_start_loc[s];
        item_start[s + 1] = item_start[s] + num_kv_heads * head_parts * ((rows + tile_rows - 1) / tile_rows);
    }
    const Items items = {item_start, query_start_loc, context_lens, tile_rows, head_parts, sliding_window};
    const int64_t num_items = item_start[num_seqs];
    /* The items are taken in order, one at a time, each thread knowing its next one (to
     * fetch its keys meanwhile: Ahead). */
    int64_t taken = 0;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        const int64_t span = max_context_len > 0 ? max_context_len : 1;
        float *scratch = malloc((size_t)(MAX_TILE * span) * sizeof(float));
        int64_t item = __atomic_fetch_add(&taken, 1, __ATOMIC_RELAXED);
        Item it = item < num_items ? item_at(&items, item, 0) : (Item){0};
        for (int64_t next; item < num_items; item = next) {
            next = __atomic_fetch_add(&taken, 1, __ATOMIC_RELAXED);
            /* The next item, decoded once: this item fetches its keys, then it runs. */
            const Item following = next < num_items ? item_at(&items, next, it.seq) : it;
            if (!scratch) {
                failed = 1;
                it = following;
                continue;
            }
            const int64_t s = it.seq;
            const int64_t rows = query_start_loc[s + 1] - query_start_loc[s];
            const int32_t *blocks = block_table + s * table_width;
            const int64_t kv_offset = it.kv_head * head_dim;
            Query tile[MAX_TILE];
            int n = 0;
            for (int64_t r = it.row_begin; r < it.row_end; r++) {
                const int64_t t = query_start_loc[s] + r;
                const int64_t position = context_lens[s] - rows + r;
                for (int64_t i = it.part * heads_per_item; i < group && i < (it.part + 1) * heads_per_item; i++) {
                    const int64_t h = it.kv_head * group + i;
                    Query *qr = &tile[n];
                    qr->q = query + (t * num_heads + h) * head_dim;
                    qr->o = out + (t * num_heads + h) * head_dim;
                    qr->scores = scratch + n * span;
                    qr->first = first_key(position, sliding_window);
                    qr->position = position;
                    n++;
                }
            }
            const int64_t lo = it.lo, hi = it.hi;
            /* q.k: each key read once for every query of the tile that sees it. */
            for (int64_t j = lo; j <= hi;) {
                const int64_t block = j / block_size;
                const int64_t end = (block + 1) * block_size - 1 < hi ? (block + 1) * block_size - 1 : hi;
                const int64_t slot = SLOT(blocks, j);
                const float *k = key_cache + slot * token_stride + kv_offset;
                /* The cache is read a block at a time from scattered places: ask for the
                 * next block's keys one block ahead, and for these values (P.V reads them
                 * next), so that memory is fetched while the dot products run. */
                const float *v = value_cache + slot * token_stride + kv_offset;
                const float *next_k = (block + 1) * block_size <= hi
                    ? key_cache + ((int64_t)blocks[block + 1] * block_size + j % block_size) * token_stride + kv_offset
                    : NULL;
                while (j <= end) {
                    const int keys = end - j + 1 < block_keys ? (int)(end - j + 1) : block_keys;
                    if (next_k) prefetch_slots(next_k, keys, token_stride, head_dim, _MM_HINT_T0);
                    prefetch_slots(v, keys, token_stride, head_dim, _MM_HINT_T1);
                    for (int i0 = 0; i0 < n; i0 += QUERIES) {
                        const int nq = n - i0 < QUERIES ? n - i0 : QUERIES;
                        if (wide)
                            wide_score_keys(tile + i0, nq, k, token_stride, keys, j, head_dim, scale, softcap);
                        else
                            score_keys(tile + i0, nq, k, token_stride, keys, j, head_dim, scale, softcap);
                    }
                    j += keys;
                    k += keys * token_stride;
                    v += keys * token_stride;
                    if (next_k) next_k += keys * token_stride;
                }
            }
            /* The next item's keys, fetched during P.V: nothing after the last item, nor
             * for more rows of these keys (a prompt's next rows: q.k has just read them). */
            Ahead ahead = {.j = 1, .last = 0};
            if (following.seq != s || following.kv_head != it.kv_head) {
                const float *cache = key_cache + following.kv_head * head_dim;
                const int32_t *its_blocks = block_table + following.seq * table_width;
                ahead = (Ahead){cache, its_blocks, block_size, token_stride, (head_dim + 15) / 16,
                                following.lo, following.hi, 0,
                                cache + SLOT(its_blocks, following.lo) * token_stride};
            }
            /* The softmax's weights, then P.V in registers over each query's own keys in
             * order (its values stay in cache from one query to the next); with AVX-512 the
             * heads of a row (consecutive in the tile, the same keys) together. */
            for (int i = 0; i < n; i++) exponentiate(&tile[i]);
            for (int i = 0; i < n;) {
                int same = 1;
                if (wide_values) {
                    while (same < ROW_HEADS && i + same < n && tile[i + same].position == tile[i].position &&
                           tile[i + same].first == tile[i].first)
                        same++;
                    row_values_of(tile + i, same, value_cache, blocks, block_size, token_stride, kv_offset, head_dim,
                                  &ahead);
                } else {
                    weighted_values(&tile[i], value_cache, blocks, block_size, token_stride, kv_offset, head_dim,
                                    &ahead);
                }
                i += same;
            }
            it = following;
        }
        free(scratch);
    }
    free(item_start);
    return failed ? -1 : 0;
}

/* ---- the step's new keys and values into the cache -------------------------------------- */

/* Row t of key and value (row_floats floats each, rows key_stride / value_stride floats
 * apart) into cache slot slots[t] of key_cache and value_cache (slots row_floats apart):
 * a plain copy, twice as fast in a decode step as torch's index_copy_ (measured: 1.85 ->
 * 0.85 ms a step at batch 64; streaming stores gained nothing more). */
void write_kv(const float *key, const float *value, int64_t key_stride, int64_t value_stride,
              const int64_t *slots, int64_t rows, int64_t row_floats, float *key_cache,
              float *value_cache) {
    const size_t bytes = (size_t)row_floats * sizeof(float);
    for (int64_t t = 0; t < rows; t++) {
        memcpy(key_cache + slots[t] * row_floats, key + t * key_stride, bytes);
        memcpy(value_cache + slots[t] * row_floats, value + t * value_stride, bytes);
    }
}
