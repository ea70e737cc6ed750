/* Part 14 of the shim: the dumped processes' smaps read ahead (smaps-ahead.c). */
#ifndef GROVE_SMAPS_AHEAD_H
#define GROVE_SMAPS_AHEAD_H

/* With GROVE_READ_AHEAD_SMAPS=1, once the tree is frozen: starts the thread that reads them. */
void smaps_ahead_start(void);

/* `fd` was just opened on a path CRIU asked for; where it is a smaps file the thread has read,
 * its copy takes the fd's number. Returns the fd. */
int smaps_ahead_take(int fd);

/* Waits until the thread has ended; returns whether one ran. */
int smaps_ahead_stop(void);

#endif
