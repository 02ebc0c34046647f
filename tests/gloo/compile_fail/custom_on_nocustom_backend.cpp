// Must not compile: a custom callable on a backend that cannot run one. The backend here is a
// minimal test double (a Gloo policy that reports custom_reductions = false).
#include <comm/backends/gloo.hpp>
#include <comm/communicator.hpp>

#include <vector>

struct NoCustom : comm::backends::Gloo {
  static constexpr bool custom_reductions = false;
  NoCustom(comm::backends::Gloo g) : comm::backends::Gloo(std::move(g)) {}
  [[nodiscard]] static NoCustom create(std::shared_ptr<comm::Store> s, int r, int n, const Options& o) {
    return NoCustom(comm::backends::Gloo::create(std::move(s), r, n, o));
  }
};

void f(comm::Communicator<NoCustom>& c) {
  std::vector<float> v(4);
  c.all_reduce(v, [](float a, float b) { return a + b; });
}

int main() {}
