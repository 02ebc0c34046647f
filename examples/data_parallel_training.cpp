// Data-parallel training of a small MLP in plain C++, the way PyTorch DDP does it:
//
//   comm-run -n 4 ./data_parallel_training [--backend auto|gloo|shm|hierarchical|...] [--steps N]
//                                          [--checkpoint PATH] [--lr X]
//
//   - every rank starts from rank 0's initial weights (broadcast);
//   - each step's global batch of 64 samples is split across the ranks; each rank runs forward and
//     backward on its share;
//   - backward runs layer by layer from the output, and as soon as a layer's gradients (a bucket)
//     are complete they are all-reduced asynchronously (comm::async returns a comm::Work) while the
//     next layer's gradients are computed; the step waits for every bucket, then divides the sums
//     by the global batch size (the average gradient, also when the ranks' shares differ);
//   - half way, rank 0 alone writes a checkpoint (weights, momentum, step); after a barrier every
//     rank loads it and training goes on from it;
//   - rank 0 prints the loss every 50 steps and at the end. It does not depend on the number of
//     ranks beyond float rounding: 1 rank and 4 ranks print the same losses to about 6 digits
//     (tests/examples checks it on every CPU backend).
//
// --elastic trains through faults (Gloo, Shm, Hierarchical; under comm-run --max-restarts N):
//   - when an operation fails (a rank died, or revoked the communicator), the survivors call
//     comm::shrink_world() and redo the step with the same global batch split over fewer ranks; a
//     rank that saw the step complete (every rank's part was in it) is furthest on, and the others
//     take its state, so that every survivor goes on from the same step;
//   - at each step boundary they call comm::grow_world() (one store round trip when nobody waits):
//     a replacement that comm-run started (its init_distributed() joins the running job) receives
//     the step, the weights and the momentum from rank 0 and goes on with the others;
//   - the global batch and its average do not depend on the number of ranks, so a run with faults
//     prints the same losses as a run without (to float rounding).
//   --kill R:S[,R:S...]: fault injection, the process started as rank R SIGKILLs itself at step S
//   (its replacement does not); --revoke-step S: rank 0 revokes the communicator at step S.
//
// With COMM_COMMS_LOG=ops.csv or COMM_TRACE=trace.json the collectives' times are recorded (see
// the README, "Comms log and trace"): the trace shows each bucket's all_reduce overlapping the
// next bucket's backward.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>
#include <limits>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <comm/comm.hpp>

namespace {

constexpr int kIn = 8;               // inputs per sample
constexpr int kHidden = 32;          // two hidden layers of this width, tanh
constexpr int kSamples = 1024;       // the data set
constexpr int kGlobalBatch = 64;     // samples per step, over all ranks
constexpr float kMomentum = 0.9f;

/// The parameters, one flat vector, layer by layer, so that a layer's gradients are one
/// contiguous bucket: [W1 (hidden x in), b1] [W2 (hidden x hidden), b2] [W3 (hidden), b3].
struct Layout {
  static constexpr std::size_t w1 = 0, b1 = w1 + kHidden * kIn;
  static constexpr std::size_t w2 = b1 + kHidden, b2 = w2 + kHidden * kHidden;
  static constexpr std::size_t w3 = b2 + kHidden, b3 = w3 + kHidden;
  static constexpr std::size_t size = b3 + 1;
  /// The buckets in the order backward completes them: layer 3, layer 2, layer 1.
  static constexpr std::array<std::pair<std::size_t, std::size_t>, 3> buckets{
      {{w3, size - w3}, {w2, w3 - w2}, {w1, w2 - w1}}};
};

struct Sample {
  std::array<float, kIn> x;
  float target;
};

/// A fixed data set from a smooth function of the inputs (the same on every rank).
std::vector<Sample> make_data() {
  std::mt19937 gen(12345);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<Sample> data(kSamples);
  for (auto& s : data) {
    for (auto& v : s.x) v = u(gen);
    s.target = std::sin(s.x[0] + 2.0f * s.x[1]) + 0.5f * s.x[2] * s.x[3] - 0.3f * s.x[4] + 0.1f * std::cos(3.0f * s.x[5]);
  }
  return data;
}

std::vector<float> init_params() {
  std::mt19937 gen(7);
  std::vector<float> p(Layout::size, 0.0f);
  std::normal_distribution<float> n1(0.0f, 1.0f / std::sqrt(static_cast<float>(kIn)));
  std::normal_distribution<float> n2(0.0f, 1.0f / std::sqrt(static_cast<float>(kHidden)));
  for (std::size_t i = Layout::w1; i < Layout::b1; ++i) p[i] = n1(gen);
  for (std::size_t i = Layout::w2; i < Layout::b2; ++i) p[i] = n2(gen);
  for (std::size_t i = Layout::w3; i < Layout::b3; ++i) p[i] = n2(gen);
  return p;
}

/// What forward keeps for backward, per sample of this rank's share.
struct Activations {
  std::array<float, kHidden> a1, a2;
  float dy;  // d loss / d output = output - target
};

/// Forward over `share`; returns the sum of the samples' losses (0.5 * error^2).
double forward(const std::vector<float>& p, std::span<const Sample> share, std::vector<Activations>& acts) {
  double loss = 0;
  acts.resize(share.size());
  for (std::size_t k = 0; k < share.size(); ++k) {
    const Sample& s = share[k];
    Activations& a = acts[k];
    for (int j = 0; j < kHidden; ++j) {
      float z = p[Layout::b1 + j];
      for (int i = 0; i < kIn; ++i) z += p[Layout::w1 + j * kIn + i] * s.x[i];
      a.a1[j] = std::tanh(z);
    }
    for (int j = 0; j < kHidden; ++j) {
      float z = p[Layout::b2 + j];
      for (int i = 0; i < kHidden; ++i) z += p[Layout::w2 + j * kHidden + i] * a.a1[i];
      a.a2[j] = std::tanh(z);
    }
    float y = p[Layout::b3];
    for (int i = 0; i < kHidden; ++i) y += p[Layout::w3 + i] * a.a2[i];
    a.dy = y - s.target;
    loss += 0.5 * static_cast<double>(a.dy) * a.dy;
  }
  return loss;
}

/// One layer's part of backward: sums its gradients over the share into `g` (the bucket), and
/// turns the deltas of its output into the deltas of its input.
void backward_layer3(const std::vector<float>& p, const std::vector<Activations>& acts, std::vector<float>& g,
                     std::vector<std::array<float, kHidden>>& delta2) {
  delta2.resize(acts.size());
  for (std::size_t k = 0; k < acts.size(); ++k) {
    const Activations& a = acts[k];
    for (int i = 0; i < kHidden; ++i) g[Layout::w3 + i] += a.dy * a.a2[i];
    g[Layout::b3] += a.dy;
    for (int i = 0; i < kHidden; ++i) delta2[k][i] = p[Layout::w3 + i] * a.dy * (1.0f - a.a2[i] * a.a2[i]);
  }
}

void backward_layer2(const std::vector<float>& p, const std::vector<Activations>& acts,
                     const std::vector<std::array<float, kHidden>>& delta2, std::vector<float>& g,
                     std::vector<std::array<float, kHidden>>& delta1) {
  delta1.resize(acts.size());
  for (std::size_t k = 0; k < acts.size(); ++k) {
    for (int j = 0; j < kHidden; ++j) {
      for (int i = 0; i < kHidden; ++i) g[Layout::w2 + j * kHidden + i] += delta2[k][j] * acts[k].a1[i];
      g[Layout::b2 + j] += delta2[k][j];
    }
    for (int i = 0; i < kHidden; ++i) {
      float s = 0;
      for (int j = 0; j < kHidden; ++j) s += p[Layout::w2 + j * kHidden + i] * delta2[k][j];
      delta1[k][i] = s * (1.0f - acts[k].a1[i] * acts[k].a1[i]);
    }
  }
}

void backward_layer1(std::span<const Sample> share, const std::vector<std::array<float, kHidden>>& delta1,
                     std::vector<float>& g) {
  for (std::size_t k = 0; k < share.size(); ++k)
    for (int j = 0; j < kHidden; ++j) {
      for (int i = 0; i < kIn; ++i) g[Layout::w1 + j * kIn + i] += delta1[k][j] * share[k].x[i];
      g[Layout::b1 + j] += delta1[k][j];
    }
}

/// The checkpoint: a tag, the step, the weights and the momentum.
constexpr char kMagic[8] = {'c', 'o', 'm', 'm', 'd', 'p', '0', '1'};

void save_checkpoint(const std::string& path, std::uint64_t step, const std::vector<float>& p,
                     const std::vector<float>& m) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    const std::uint64_t n = p.size();
    f.write(kMagic, sizeof kMagic);
    f.write(reinterpret_cast<const char*>(&step), sizeof step);
    f.write(reinterpret_cast<const char*>(&n), sizeof n);
    f.write(reinterpret_cast<const char*>(p.data()), static_cast<std::streamsize>(n * sizeof(float)));
    f.write(reinterpret_cast<const char*>(m.data()), static_cast<std::streamsize>(n * sizeof(float)));
    if (!f.flush()) throw std::runtime_error("cannot write the checkpoint " + tmp);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) throw std::runtime_error("cannot rename the checkpoint to " + path);
}

std::uint64_t load_checkpoint(const std::string& path, std::vector<float>& p, std::vector<float>& m) {
  std::ifstream f(path, std::ios::binary);
  char magic[sizeof kMagic];
  std::uint64_t step = 0, n = 0;
  f.read(magic, sizeof magic);
  f.read(reinterpret_cast<char*>(&step), sizeof step);
  f.read(reinterpret_cast<char*>(&n), sizeof n);
  if (!f || std::memcmp(magic, kMagic, sizeof kMagic) != 0 || n != p.size())
    throw std::runtime_error("'" + path + "' is not a checkpoint of this model");
  f.read(reinterpret_cast<char*>(p.data()), static_cast<std::streamsize>(n * sizeof(float)));
  f.read(reinterpret_cast<char*>(m.data()), static_cast<std::streamsize>(n * sizeof(float)));
  if (!f) throw std::runtime_error("the checkpoint '" + path + "' is truncated");
  return step;
}

struct Args {
  std::string backend = "auto";
  int steps = 300;
  float lr = 0.05f;
  std::string checkpoint = "data_parallel.ckpt";
  bool elastic = false;
  std::vector<std::pair<int, int>> kills;  // (rank started as, step)
  int revoke_step = -1;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--elastic") {
      a.elastic = true;
      continue;
    }
    if (i + 1 >= argc) throw std::runtime_error("option " + k + " needs a value");
    const std::string v = argv[++i];
    if (k == "--backend")
      a.backend = v;
    else if (k == "--steps")
      a.steps = std::max(2, std::stoi(v));
    else if (k == "--lr")
      a.lr = std::stof(v);
    else if (k == "--checkpoint")
      a.checkpoint = v;
    else if (k == "--kill")
      for (std::size_t at = 0; at < v.size();) {
        const auto comma = std::min(v.find(',', at), v.size());
        const std::string item = v.substr(at, comma - at);
        const auto colon = item.find(':');
        if (colon == std::string::npos) throw std::runtime_error("--kill takes RANK:STEP[,RANK:STEP...]");
        a.kills.emplace_back(std::stoi(item.substr(0, colon)), std::stoi(item.substr(colon + 1)));
        at = comma + 1;
      }
    else if (k == "--revoke-step")
      a.revoke_step = std::stoi(v);
    else
      throw std::runtime_error("unknown option " + k);
  }
  return a;
}

/// The model's state, and one step's worth of work on it (shared by both modes).
struct Trainer {
  const Args& args;
  std::vector<Sample> data = make_data();
  std::vector<float> params = init_params();
  std::vector<float> momentum = std::vector<float>(Layout::size, 0.0f);
  std::vector<float> grad = std::vector<float>(Layout::size);
  std::vector<double> loss = std::vector<double>(1);
  std::vector<Activations> acts;
  std::vector<std::array<float, kHidden>> delta1, delta2;

  /// A failed step's operations that had not ended a second after the failure, with the buffers
  /// they may still write (the Work contract): kept until they end, while training goes on with
  /// fresh buffers.
  struct Parked {
    std::vector<comm::Work> works;
    std::vector<float> grad;
    std::vector<double> loss;
  };
  std::vector<Parked> parked;

  /// Waits for the step's operations. On a failure, the others get a second to end (with their
  /// error); any still running are parked with their buffers; then the first error is thrown.
  /// Nothing failing, it waits as Work::wait does, to the communicator's timeout.
  void finish(std::vector<comm::Work>& pending) {
    std::erase_if(parked, [](Parked& p) {
      return std::all_of(p.works.begin(), p.works.end(), [](const comm::Work& w) { return w.is_completed(); });
    });
    using Clock = std::chrono::steady_clock;
    const auto deadline = Clock::now() + comm::timeout_from_env() + std::chrono::seconds(1);
    auto give_up = Clock::time_point::max();  // a second after the first failure
    std::exception_ptr failure;
    for (;;) {
      comm::Work* running = nullptr;
      for (auto& w : pending) {
        if (!w.is_completed()) {
          if (running == nullptr) running = &w;
          continue;
        }
        if (w.failed() && !failure) {
          try {
            w.wait();
          } catch (...) {
            failure = std::current_exception();
            give_up = Clock::now() + std::chrono::seconds(1);
          }
        }
      }
      if (running == nullptr) break;
      if (Clock::now() >= give_up) {
        Parked p{{}, std::move(grad), std::move(loss)};
        for (auto& w : pending)
          if (!w.is_completed()) p.works.push_back(std::move(w));
        parked.push_back(std::move(p));
        grad.assign(Layout::size, 0.0f);
        loss.assign(1, 0.0);
        break;
      }
      if (Clock::now() >= deadline) running->wait();  // throws its Timeout
      try {
        (void)running->wait_for(std::chrono::milliseconds(5));
      } catch (...) {  // its failure: read in the next round
      }
    }
    if (failure) std::rethrow_exception(failure);
  }

  /// Step `step` on `world`: this rank's share of the global batch, forward, backward with each
  /// bucket's all_reduce overlapping the next bucket's backward, then SGD with momentum on the
  /// average gradient. Returns the step's mean loss. Throws comm::Error before the update when an
  /// operation fails (the state is then as it was).
  double step(comm::AnyCommunicator& world, int step) {
    const int rank = world.rank(), n = world.size();
    // This rank's share of the step's global batch (shares differ by one when n does not divide it).
    const int first = (step * kGlobalBatch) % kSamples;
    const int lo = kGlobalBatch * rank / n, hi = kGlobalBatch * (rank + 1) / n;
    const std::span<const Sample> share(data.data() + first + lo, static_cast<std::size_t>(hi - lo));

    std::fill(grad.begin(), grad.end(), 0.0f);
    loss.assign(1, forward(params, share, acts));
    std::vector<comm::Work> pending;
    pending.push_back(world.all_reduce(std::span<double>(loss), comm::ReduceOp::sum, comm::async));

    // Backward, bucket by bucket: each bucket's all_reduce runs while the next one is computed.
    auto bucket = [&](std::size_t b) {
      const auto [offset, count] = Layout::buckets[b];
      return std::span<float>(grad.data() + offset, count);
    };
    backward_layer3(params, acts, grad, delta2);
    pending.push_back(world.all_reduce(bucket(0), comm::ReduceOp::sum, comm::async));
    backward_layer2(params, acts, delta2, grad, delta1);
    pending.push_back(world.all_reduce(bucket(1), comm::ReduceOp::sum, comm::async));
    backward_layer1(share, delta1, grad);
    pending.push_back(world.all_reduce(bucket(2), comm::ReduceOp::sum, comm::async));
    finish(pending);

    // SGD with momentum on the average gradient over the global batch.
    const float scale = 1.0f / static_cast<float>(kGlobalBatch);
    for (std::size_t i = 0; i < params.size(); ++i) {
      momentum[i] = kMomentum * momentum[i] + grad[i] * scale;
      params[i] -= args.lr * momentum[i];
    }
    return loss[0] / kGlobalBatch;
  }

  void report(comm::AnyCommunicator& world, int step, double mean_loss) const {
    if (world.rank() == 0 && (step % 50 == 0 || step == args.steps - 1)) std::printf("step %d loss %.9g\n", step, mean_loss);
    if (step == args.steps - 1 && world.rank() == 0) std::printf("final loss %.9g\n", mean_loss);
    std::fflush(stdout);
  }
};

long long mono_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

/// --elastic (see the file comment).
int train_elastic(const Args& args) {
  const long long started_ns = mono_ns();
  const char* restarts = std::getenv("COMM_RESTART_COUNT");
  const bool replacement = restarts != nullptr && std::atoi(restarts) > 0;
  const char* launch_rank = std::getenv("RANK");
  const int started_as = launch_rank != nullptr ? std::atoi(launch_rank) : -1;

  comm::InitOptions o;
  o.backend = args.backend;
  comm::AnyCommunicator* joined = nullptr;
  try {
    joined = &comm::init_distributed(o);  // a replacement returns when the members next grow()
  } catch (const comm::InvalidArgument& e) {
    if (replacement && e.op() == "join") {  // the job finished before this process could join
      std::printf("replacement: nothing to join, the job has finished\n");
      return 0;
    }
    throw;
  }
  comm::AnyCommunicator& world = *joined;
  Trainer t{args};
  int step = 0;
  bool revoked = false;  // --revoke-step: once
  // The step, the weights and the momentum, from `root` to every rank (newcomers after a grow, the
  // ranks that are behind after a shrink).
  auto share_state = [&](int root) {
    std::vector<std::int64_t> at{step};
    world.broadcast(std::span<std::int64_t>(at), root);
    step = static_cast<int>(at[0]);
    world.broadcast(std::span<float>(t.params), root);
    world.broadcast(std::span<float>(t.momentum), root);
  };
  bool have_state = !replacement;  // a newcomer has none until share_state() completes
  if (replacement) {
    try {
      share_state(0);
      have_state = true;
      std::printf("replacement: joined as rank %d of %d at step %d, %.1f ms after its start\n", world.rank(),
                  world.size(), step, static_cast<double>(mono_ns() - started_ns) / 1e6);
    } catch (const comm::Error& e) {  // a member died meanwhile: the loop's first grow() fails, then recovers
      std::printf("replacement: the state did not arrive (%s)\n", e.what());
    }
  } else {
    world.broadcast(std::span<float>(t.params), 0);  // everyone starts from rank 0's weights
    if (world.rank() == 0)
      std::printf("training an MLP (%zu parameters) on %d rank(s) over %s, global batch %d, elastic\n",
                  t.params.size(), world.size(), std::string(world.backend()).c_str(), kGlobalBatch);
  }
  std::fflush(stdout);

  long long failed_at = 0;  // when this rank saw the failure it is recovering from (0: none)
  // The survivors' new world, and the step they all go on from: a step whose all_reduces
  // completed on some rank had every rank's contribution, so its result is the fault-free one; the
  // ranks that did not see it complete (or a newcomer whose state did not arrive) take the state
  // of the lowest rank that is furthest on.
  auto recover = [&] {
    comm::shrink_world();
    std::vector<std::int64_t> furthest{have_state ? step : -1};
    world.all_reduce(std::span<std::int64_t>(furthest), comm::ReduceOp::max);
    std::vector<std::int32_t> source{have_state && step == furthest[0] ? world.rank() : world.size()};
    world.all_reduce(std::span<std::int32_t>(source), comm::ReduceOp::min);
    share_state(source[0]);
    have_state = true;
  };

  // A newcomer joined inside the members' grow_world() of this step boundary, so its loop starts
  // past that call: calling it again would put this process one grow ahead of the members, and
  // with another replacement waiting it would admit it alone, connecting while the members run
  // this step's all_reduces (each side then waits for the other until the timeout).
  bool past_grow = have_state && replacement;
  while (step < args.steps) {
    try {
      const int before = world.size();
      if (!std::exchange(past_grow, false)) comm::grow_world();  // each step boundary: one store round trip when nobody waits
      if (world.size() != before) {
        share_state(0);  // rank 0 is a member: members rank before newcomers
        if (world.rank() == 0) std::printf("grew from %d to %d rank(s) at step %d\n", before, world.size(), step);
      }
      const bool kill_now = std::find(args.kills.begin(), args.kills.end(), std::make_pair(started_as, step)) !=
                            args.kills.end();
      if (!replacement && kill_now) {
        std::printf("KILL rank=%d step=%d t_ns=%lld\n", started_as, step, mono_ns());
        std::fflush(stdout);
        std::raise(SIGKILL);
      }
      if (step == args.revoke_step && world.rank() == 0 && !replacement && !revoked) {
        std::printf("rank 0 revokes the communicator at step %d\n", step);
        revoked = true;
        world.revoke("the example's --revoke-step");
      }
      const double loss = t.step(world, step);
      if (failed_at != 0) {  // the first collective after the recovery succeeded
        std::printf("RECOVERED rank=%d size=%d t_ns=%lld ms=%.3f\n", world.rank(), world.size(), mono_ns(),
                    static_cast<double>(mono_ns() - failed_at) / 1e6);
        failed_at = 0;
      }
      t.report(world, step, loss);
      ++step;
    } catch (const comm::Error& e) {
      if (failed_at == 0) failed_at = mono_ns();
      std::printf("rank %d: %s; shrinking\n", world.rank(), e.what());
      std::fflush(stdout);
      // A rank may die during the recovery too: then shrink again, to the deadline.
      for (int attempt = 1;; ++attempt) {
        try {
          recover();
          break;
        } catch (const comm::Error& again) {
          // The agreement itself failed (its deadline, or the store is gone): no second try helps.
          if (again.op() == "shrink" || attempt >= 8) throw;
          std::printf("rank %d: recovery failed (%s); shrinking again\n", world.rank(), again.what());
          std::fflush(stdout);
        }
      }
    }
  }
  world.close_joins();  // replacements still on their way exit instead of waiting
  world.barrier();
  comm::destroy();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Args args = parse(argc, argv);
    if (args.elastic) return train_elastic(args);
    comm::InitOptions o;
    o.backend = args.backend;
    comm::AnyCommunicator& world = comm::init_distributed(o);
    const int rank = world.rank(), n = world.size();

    Trainer t{args};
    world.broadcast(std::span<float>(t.params), 0);  // everyone starts from rank 0's weights
    if (rank == 0)
      std::printf("training an MLP (%zu parameters) on %d rank(s) over %s, global batch %d\n", t.params.size(), n,
                  std::string(world.backend()).c_str(), kGlobalBatch);

    const int save_at = args.steps / 2;
    for (int step = 0; step < args.steps; ++step) {
      t.report(world, step, t.step(world, step));
      if (step + 1 == save_at) {
        // Rank 0 writes; the barrier orders every rank's read after the write.
        if (rank == 0) save_checkpoint(args.checkpoint, static_cast<std::uint64_t>(step + 1), t.params, t.momentum);
        world.barrier();
        const std::uint64_t resumed = load_checkpoint(args.checkpoint, t.params, t.momentum);
        if (resumed != static_cast<std::uint64_t>(step + 1)) throw std::runtime_error("the checkpoint is of another step");
        if (rank == 0)
          std::printf("checkpoint of step %llu written by rank 0 to %s, loaded by all %d rank(s)\n",
                      static_cast<unsigned long long>(resumed), args.checkpoint.c_str(), n);
      }
    }
    world.barrier();
    comm::destroy();
    return 0;
  } catch (const comm::Error& e) {
    std::fprintf(stderr, "data_parallel_training: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "data_parallel_training: %s\n", e.what());
    return 1;
  }
}
