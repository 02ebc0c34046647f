#pragma once
// PrefixStore: definitions (declared in <comm/store.hpp>).
// Included by <comm/store.hpp> after the declarations, and only from there: the public header
// declares, detail/ defines, and nothing here includes back up (include <comm/store.hpp>).

namespace comm {

inline PrefixStore::PrefixStore(std::string prefix, std::shared_ptr<Store> base)
    : prefix_(std::move(prefix)), base_(std::move(base)) {
  if (!base_) throw InvalidArgument("store.prefix", -1, "PrefixStore '" + prefix_ + "' needs a store, got null");
  set_timeout(base_->timeout());
  set_rank(base_->rank());
}

inline std::string PrefixStore::full(std::string_view key) const {
  std::string k;
  k.reserve(prefix_.size() + 1 + key.size());
  k += prefix_;
  k += '/';
  k += key;
  return k;
}

inline void PrefixStore::set(std::string_view key, std::span<const std::uint8_t> value) { base_->set(full(key), value); }

inline Store::Bytes PrefixStore::get(std::string_view key) {
  const std::string k = full(key);
  // The base's get() uses the base's timeout; wait first when ours differs.
  if (timeout() != base_->timeout()) {
    try {
      base_->wait({k}, timeout());
    } catch (const Timeout& e) {
      throw Timeout("store.get", e.rank(), e.detail(), e.peer());  // the caller asked for a get
    }
  }
  return base_->get(k);
}

inline std::int64_t PrefixStore::add(std::string_view key, std::int64_t delta) { return base_->add(full(key), delta); }

inline Store::Bytes PrefixStore::compare_set(std::string_view key, std::span<const std::uint8_t> expected,
                                             std::span<const std::uint8_t> desired) {
  return base_->compare_set(full(key), expected, desired);
}

inline void PrefixStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  std::vector<std::string> ks;
  ks.reserve(keys.size());
  for (const auto& k : keys) ks.push_back(full(k));
  base_->wait(ks, timeout);
}

inline std::vector<Store::Bytes> PrefixStore::multi_get(const std::vector<std::string>& keys,
                                                        std::chrono::milliseconds timeout) {
  std::vector<std::string> ks;
  ks.reserve(keys.size());
  for (const auto& k : keys) ks.push_back(full(k));
  return base_->multi_get(ks, timeout);
}

inline std::int64_t PrefixStore::num_keys() { return base_->num_keys(); }

inline bool PrefixStore::delete_key(std::string_view key) { return base_->delete_key(full(key)); }

inline bool PrefixStore::check(std::string_view key) { return base_->check(full(key)); }

}  // namespace comm
