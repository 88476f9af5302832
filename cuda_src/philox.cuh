// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011): a counter-based
// generator, so any thread can draw the random number of any (counter, key) without state. The NumPy twin
// is cupyflash/philox.py; tests check both against the paper's known-answer vectors and each other.
#pragma once
#include "common.cuh"  // unsigned comes with the CUDA headers it includes

namespace cupyflash {

struct Philox4 {
  unsigned x, y, z, w;
};

// Ten rounds of: (hi0, lo0) = M0 c0, (hi1, lo1) = M1 c2, c = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0), then the
// key bumped by the Weyl constants (W0, W1).
__device__ __forceinline__ Philox4 philox4x32_10(Philox4 c, unsigned k0, unsigned k1) {
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const unsigned lo0 = 0xD2511F53u * c.x, hi0 = __umulhi(0xD2511F53u, c.x);
    const unsigned lo1 = 0xCD9E8D57u * c.z, hi1 = __umulhi(0xCD9E8D57u, c.z);
    c = {hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0};
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c;
}

}  // namespace cupyflash
