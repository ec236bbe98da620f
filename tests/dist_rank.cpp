// One rank of the multi-process test: tests/run_ranks.sh starts N of these
// with torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1,
// MASTER_PORT). Each joins the group through ampfuse::distributed (TCPStore,
// Gloo), steps its part of one model under a GradScaler across the ranks
// (tests/sharded_model.h: FusedAdam with clipping, then torch::optim::SGD
// with unscale_, an inf on one rank at step 3) and checks every step against
// the whole model stepped in this process alone; then ZeroOptimizer(FusedAdam)
// over the whole model, data parallel, against FusedAdam in this process. Exit status 0 when all
// agree; every collective times out after 30 s.

#include <ampfuse/ampfuse.h>

#include <cstdio>
#include <cstdlib>

#include "tests/sharded_model.h"

int main() {
  namespace sharded = ampfuse_test::sharded;
  try {
    const auto env = ampfuse::distributed::launch_env();
    const auto group = ampfuse::distributed::init_process_group(env, /*cuda=*/false, std::chrono::seconds(30));
    const char* seed_text = std::getenv("AMPFUSE_TEST_SEED");
    const std::uint64_t seed = seed_text ? std::strtoull(seed_text, nullptr, 10) : 1234;
    const sharded::Model model = sharded::make_model(seed, /*steps=*/8, /*inf_step=*/3);
    std::size_t failures = 0;
    for (const sharded::Flow flow : {sharded::Flow{false, true}, sharded::Flow{true, true}}) {
      const auto errors =
          sharded::check_rank(model, flow, sharded::whole(model, flow), env.rank, env.world_size, group);
      for (const auto& e : errors) std::fprintf(stderr, "%s\n", e.c_str());
      failures += errors.size();
    }
    // Data parallelism with the optimizer state sharded (ZeroOptimizer).
    const auto zero_errors = sharded::check_zero_rank(model, env.rank, env.world_size, group);
    for (const auto& e : zero_errors) std::fprintf(stderr, "%s\n", e.c_str());
    failures += zero_errors.size();
    group->barrier()->wait();  // no rank leaves while another still reduces
    std::printf("rank %d of %d (seed %llu): %s\n", env.rank, env.world_size, static_cast<unsigned long long>(seed),
                failures == 0 ? "stepped as one process" : "differs from one process");
    return failures == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
}
