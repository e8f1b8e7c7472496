// A JVM heapprofd joins and leaves (tests/inject_stress.rs): THREADS threads compress
// and inflate buffers (zlib's memory comes from the C allocator) and fill direct
// buffers (ByteBuffer.allocateDirect, also malloc), checking each round trip; the main
// thread prints "progress ROUNDS ERRORS" ten times a second until stdin closes.

import java.nio.ByteBuffer;
import java.util.Arrays;
import java.util.concurrent.atomic.AtomicLong;
import java.util.zip.DataFormatException;
import java.util.zip.Deflater;
import java.util.zip.Inflater;

public class StressAlloc {
    static final AtomicLong rounds = new AtomicLong();
    static final AtomicLong errors = new AtomicLong();

    static void work(int seed) {
        long n = seed;
        while (true) {
            n = (n * 1103515245L + 12345L) & 0x7fffffffL;
            int size = 1000 + (int) (n % 60000);
            byte[] input = new byte[size];
            for (int i = 0; i < size; i++) {
                input[i] = (byte) ((i * 7 + n) % 13);
            }
            Deflater deflater = new Deflater((int) (n % 9) + 1);
            deflater.setInput(input);
            deflater.finish();
            byte[] packed = new byte[size + 1024];
            int packedLength = deflater.deflate(packed);
            deflater.end();
            Inflater inflater = new Inflater();
            inflater.setInput(packed, 0, packedLength);
            byte[] output = new byte[size];
            boolean wrong;
            try {
                int length = inflater.inflate(output);
                wrong = length != size || !Arrays.equals(input, output);
            } catch (DataFormatException e) {
                wrong = true;
            }
            inflater.end();
            ByteBuffer direct = ByteBuffer.allocateDirect(size);
            direct.put(input);
            direct.flip();
            for (int i = 0; i < size; i += 97) {
                if (direct.get(i) != input[i]) {
                    wrong = true;
                }
            }
            if (wrong) {
                errors.incrementAndGet();
            }
            rounds.incrementAndGet();
        }
    }

    public static void main(String[] args) throws Exception {
        int count = args.length > 0 ? Integer.parseInt(args[0]) : 4;
        for (int i = 0; i < count; i++) {
            final int seed = i + 1;
            Thread thread = new Thread(() -> work(seed));
            thread.setDaemon(true);
            thread.start();
        }
        Thread reader = new Thread(() -> {
            try {
                while (System.in.read() >= 0) {
                }
            } catch (Exception e) {
            }
        });
        reader.start();
        System.out.println("ready");
        System.out.flush();
        while (reader.isAlive()) {
            Thread.sleep(100);
            System.out.println("progress " + rounds.get() + " " + errors.get());
            System.out.flush();
        }
        System.exit(0);
    }
}
