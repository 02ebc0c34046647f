#pragma once
// HashStore: definitions (declared in <comm/store.hpp>).
// Included by <comm/store.hpp> after the declarations, and only from there: the public header
// declares, detail/ defines, and nothing here includes back up (include <comm/store.hpp>).

#include <comm/detail/net/socket.hpp>
#include <comm/detail/store/common.hpp>

namespace comm {

inline void HashStore::set(std::string_view key, std::span<const std::uint8_t> value) {
  {
    std::lock_guard lk(mu_);
    auto it = kv_.find(key);
    if (it == kv_.end()) {
      kv_.emplace(std::string(key), Bytes(value.begin(), value.end()));
    } else {
      it->second.assign(value.begin(), value.end());
    }
  }
  cv_.notify_all();
}

inline Store::Bytes HashStore::get(std::string_view key) {
  const auto t = timeout();
  const auto deadline = detail::deadline_after(t);
  std::unique_lock lk(mu_);
  for (;;) {
    if (auto it = kv_.find(key); it != kv_.end()) return it->second;
    if (deadline == detail::Clock::time_point::max()) {
      cv_.wait(lk);
    } else if (cv_.wait_until(lk, deadline) == std::cv_status::timeout && kv_.find(key) == kv_.end()) {
      const std::string k(key);
      throw Timeout("store.get", rank(), detail::describe_keys({&k, 1}) + " not set within " + detail::format_ms(t));
    }
  }
}

inline std::int64_t HashStore::add(std::string_view key, std::int64_t delta) {
  std::int64_t out = 0;
  {
    std::lock_guard lk(mu_);
    auto it = kv_.find(key);
    auto r = detail::apply_add(key, it == kv_.end() ? nullptr : &it->second, delta);
    if (!r.error.empty()) throw InvalidArgument("store.add", rank(), r.error);
    if (it == kv_.end()) {
      kv_.emplace(std::string(key), detail::format_counter(r.value));
    } else {
      it->second = detail::format_counter(r.value);
    }
    out = r.value;
  }
  cv_.notify_all();
  return out;
}

inline Store::Bytes HashStore::compare_set(std::string_view key, std::span<const std::uint8_t> expected,
                                           std::span<const std::uint8_t> desired) {
  Bytes out;
  bool changed = false;
  {
    std::lock_guard lk(mu_);
    auto it = kv_.find(key);
    if (detail::cas_matches(it == kv_.end() ? nullptr : &it->second, expected)) {
      if (it == kv_.end()) {
        it = kv_.emplace(std::string(key), Bytes(desired.begin(), desired.end())).first;
      } else {
        it->second.assign(desired.begin(), desired.end());
      }
      changed = true;
    }
    if (it != kv_.end()) out = it->second;
  }
  if (changed) cv_.notify_all();
  return out;
}

inline void HashStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  const auto deadline = detail::deadline_after(timeout);
  std::unique_lock lk(mu_);
  auto missing = [&] {
    std::vector<std::string> m;
    for (const auto& k : keys)
      if (kv_.find(k) == kv_.end()) m.push_back(k);
    return m;
  };
  for (;;) {
    auto m = missing();
    if (m.empty()) return;
    if (deadline == detail::Clock::time_point::max()) {
      cv_.wait(lk);
    } else if (cv_.wait_until(lk, deadline) == std::cv_status::timeout) {
      m = missing();
      if (m.empty()) return;
      throw Timeout("store.wait", rank(), detail::describe_keys(m) + " not set within " + detail::format_ms(timeout));
    }
  }
}

inline std::int64_t HashStore::num_keys() {
  std::lock_guard lk(mu_);
  return static_cast<std::int64_t>(kv_.size());
}

inline bool HashStore::delete_key(std::string_view key) {
  std::lock_guard lk(mu_);
  auto it = kv_.find(key);
  if (it == kv_.end()) return false;
  kv_.erase(it);
  return true;
}

inline bool HashStore::check(std::string_view key) {
  std::lock_guard lk(mu_);
  return kv_.find(key) != kv_.end();
}

}  // namespace comm
