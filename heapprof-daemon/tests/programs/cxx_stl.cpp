/* STL containers through several levels of the program's own functions, for the
 * true-stacks tests (tests/true_stacks.rs): built with plain `g++ -O2 -g`, so without
 * frame pointers, and with the compiler free to inline the small helpers (their frames
 * come back from the debug info's inlined-subroutine records).
 *
 * Call levels of our own code: main -> workload::run -> build_records -> make_record ->
 * make_name / make_values / make_tags, plus index_records, queue_work, summarize.
 * Deterministic: same allocations on every run; no input; prints one checksum. */
#include <cstdio>
#include <deque>
#include <list>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace workload {

struct Record {
    std::string name;
    std::vector<int> values;
    std::unique_ptr<std::map<int, std::string>> tags;
};

/* Longer than std::string's 15-byte inline buffer, so every name is a heap block
 * (and `+=` below reallocates it once it outgrows its first capacity). */
__attribute__((noinline)) std::string make_name(int i) {
    std::string name = "workload-record-number-";
    name += std::to_string(i * 7919);
    name.append(static_cast<size_t>(8 + i % 17), static_cast<char>('a' + i % 26));
    return name;
}

/* Small enough to be inlined into make_record: push_back grows the vector by doubling. */
static inline std::vector<int> make_values(int i) {
    std::vector<int> values;
    for (int k = 0; k < 3 + i % 13; ++k) values.push_back(k * i);
    return values;
}

__attribute__((noinline)) std::unique_ptr<std::map<int, std::string>> make_tags(int i) {
    auto tags = std::make_unique<std::map<int, std::string>>();
    for (int k = 0; k < 1 + i % 3; ++k)
        (*tags)[k] = "a tag that is long enough to need its own heap block #" + std::to_string(k);
    return tags;
}

__attribute__((noinline)) Record make_record(int i) {
    Record record;
    record.name = make_name(i);
    record.values = make_values(i);
    if (i % 4 == 0) record.tags = make_tags(i);
    return record;
}

__attribute__((noinline)) std::vector<Record> build_records(int n) {
    std::vector<Record> records; /* no reserve: _M_realloc_insert grows it */
    for (int i = 0; i < n; ++i) records.push_back(make_record(i));
    return records;
}

__attribute__((noinline)) std::unordered_map<std::string, size_t>
index_records(const std::vector<Record> &records) {
    std::unordered_map<std::string, size_t> by_name; /* nodes hold string copies; rehashes */
    for (size_t i = 0; i < records.size(); ++i) by_name.emplace(records[i].name, i);
    return by_name;
}

__attribute__((noinline)) size_t queue_work(const std::vector<Record> &records) {
    std::deque<int> queue; /* a map of chunk pointers plus 512-byte chunks */
    std::list<std::string> done;
    for (const Record &record : records)
        for (int value : record.values) queue.push_back(value);
    size_t sum = 0;
    while (!queue.empty()) {
        sum += static_cast<size_t>(queue.front());
        queue.pop_front();
        if (sum % 97 == 0) done.push_back("finished a batch of queued work items at " + std::to_string(sum));
    }
    return sum + done.size();
}

__attribute__((noinline)) size_t summarize(const std::vector<Record> &records,
                                           const std::unordered_map<std::string, size_t> &by_name) {
    std::map<size_t, std::vector<std::string>> by_length;
    for (const auto &entry : by_name) by_length[entry.first.size()].push_back(entry.first);
    size_t sum = 0;
    for (const auto &entry : by_length) sum += entry.first * entry.second.size();
    for (const Record &record : records)
        if (record.tags) sum += record.tags->size();
    return sum;
}

__attribute__((noinline)) size_t run(int n) {
    std::vector<Record> records = build_records(n);
    auto by_name = index_records(records);
    return queue_work(records) + summarize(records, by_name);
}

} // namespace workload

int main() {
    size_t checksum = workload::run(400);
    std::printf("%zu\n", checksum);
    return checksum == 0;
}
