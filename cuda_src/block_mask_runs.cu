// create_block_mask's second kernel (cupyflash/flex_block_mask.py): the full runs that FlexMask's all_full reads
// (flex_policy.cuh), from the block states (0 empty, 1 partial, 2 full). Snippet-free: compiled once for every mask.
//
// The longest run of FULL states of each line (line L: element t at (L / per) * outer + (L % per) * inner + t * step)
// as [first, last) (the first of equal length; 0, 0 when none): BlockMask.full_kv (lines = block rows) and full_q
// (block columns). One thread a line.
extern "C" __global__ void cf_full_runs(const unsigned char* states, int* runs, long long lines, int per, int n,
                                        long long outer, long long inner, long long step) {
  const long long line = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (line >= lines) return;
  const unsigned char* x = states + (line / per) * outer + (line % per) * inner;
  int best = 0, end = 0, run = 0;
  for (int t = 0; t < n; ++t) {
    run = x[t * step] == 2 ? run + 1 : 0;
    if (run > best) best = run, end = t + 1;
  }
  runs[2 * line] = best > 0 ? end - best : 0;
  runs[2 * line + 1] = best > 0 ? end : 0;
}
