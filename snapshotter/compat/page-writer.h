/* Part 15 of the shim: pages written into their image beside CRIU (page-writer.c). */
#ifndef GROVE_PAGE_WRITER_H
#define GROVE_PAGE_WRITER_H

#include <stddef.h>
#include <sys/types.h>

/* Takes the first `len` bytes `pipe` holds for `image`, whose file position is where they go:
 * they are moved (by reference) into a pipe of the writer's, the position is moved past them,
 * and the writer thread puts them there. Returns the bytes taken (then in the image, or on their
 * way, and the position after them), or -1 when it took none (the caller writes them). */
ssize_t page_writer_take(int pipe, int image, size_t len);

/* Waits until every page taken is written and stops the writer thread; returns whether one
 * ran. The next take starts it again. */
int page_writer_stop(void);

/* Waits until every page taken is written (the writer runs on). CRIU writes into the memory of
 * the processes it dumps (ptrace pokes: compel's syscall instruction over a process's lowest
 * executable mapping, for each call it makes there, put back after it); the pages taken before
 * must reach their image as they were. */
void page_writer_drain(void);

#endif
