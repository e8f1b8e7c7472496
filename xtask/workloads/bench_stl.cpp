/* Benchmark: deep C++ stacks without frame pointers. The STL workload of the
 * true-stacks tests (heapprof-daemon/tests/programs/cxx_stl.cpp, included here
 * unchanged: records, strings, vectors, maps, an unordered_map, a deque and a list,
 * through several levels of the program's own functions) repeated ROUNDS times.
 * Built with plain `g++ -O2` (no frame pointers). Usage: bench_stl ROUNDS [RECORDS].
 * Waits for a line on stdin first, so a tracer can attach. */
#define main cxx_stl_main
#include "../../heapprof-daemon/tests/programs/cxx_stl.cpp"
#undef main

#include <cstdlib>
#include <iostream>
#include <string>

int main(int argc, char **argv) {
    long rounds = argc > 1 ? std::atol(argv[1]) : 20;
    int records = argc > 2 ? std::atoi(argv[2]) : 400;
    std::string line;
    if (!std::getline(std::cin, line)) return 1;
    size_t checksum = 0;
    for (long r = 0; r < rounds; ++r) checksum += workload::run(records);
    std::printf("%zu\n", checksum);
    return checksum == 0;
}
